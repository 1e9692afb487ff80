"""KV events of every tier, on ZMQ in vLLM's format: :mod:`.wire` (the encoding),
:mod:`.publisher` (the PUB and replay sockets). The events themselves come from
:mod:`lmtier.storage.events`."""
