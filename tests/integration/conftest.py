"""Fixtures every integration module may use without importing them: real servers.

``redis_server`` is one standalone ``redis-server`` per test module; a module that
needs another kind (a unix socket, a fresh server per test) defines its own, which
takes precedence.
"""

from support.redis_servers import redis_server

__all__ = ["redis_server"]
