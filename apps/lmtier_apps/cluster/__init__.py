"""The cluster demo's local half: docker-compose.yml's topology as local processes
(``lmtier cluster up|down|status``, :mod:`.launcher`) and the workload that tells its
story over HTTP (``lmtier cluster demo``, :mod:`.demo`), shared with compose's client.

Nothing here is imported by ``lmtier`` itself: the commands are registered through
the ``lmtier.commands`` entry point (:mod:`.cli`), and the clients they need (redis-py,
boto3, grpc, matplotlib) are imported when a command uses them.
"""
