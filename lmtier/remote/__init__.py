"""The engine's side of a sidecar: :class:`~lmtier.remote.client.SidecarStore`'s
connection, leases and streams (``lmtier.connect``). Needs the ``grpc`` extra."""
