"""How the scheduler half waits for lookups that need a remote tier (Redis, S3, a peer,
a sidecar): on a lookup thread, for at most ``lookup_wait_ms``; past it vLLM is told
"not yet" and the running lookup is kept for its next call (:func:`wait_briefly`,
:func:`keep_pending`). A failed lookup is a miss, logged once per kind of refusal
(:func:`lookup_failed`). Shared by the single-group and the hybrid scheduler.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TypeVar

from lmtier.errors import PermissionDeniedError

__all__ = ["MAX_PENDING_LOOKUPS", "keep_pending", "lookup_failed", "wait_briefly"]

logger = logging.getLogger(__name__)

MAX_PENDING_LOOKUPS = 4096
"""Background lookups kept for requests vLLM has not asked about again."""

T = TypeVar("T")
P = TypeVar("P")


def wait_briefly(future: Future[T], wait_ms: float, req_id: str, miss: T) -> T | None:
    """A background lookup's answer if it comes within ``wait_ms`` (``miss`` if it
    failed), else None: it goes on, and vLLM is told "not yet"."""
    try:
        return future.result(timeout=wait_ms / 1000)
    except TimeoutError:
        return None
    except Exception as exc:
        lookup_failed(exc, f"lookup for {req_id}")
        return miss


def keep_pending(pending: dict[str, P], req_id: str, lookup: P) -> None:
    """Keep ``req_id``'s running lookup for vLLM's next call, dropping the oldest kept
    beyond :data:`MAX_PENDING_LOOKUPS` (requests vLLM never asked about again)."""
    while len(pending) >= MAX_PENDING_LOOKUPS:
        del pending[next(iter(pending))]
    pending[req_id] = lookup


_REFUSALS_SEEN: set[str] = set()


def lookup_failed(exc: Exception, what: str) -> None:
    """Log a failed lookup (a miss). A refusal (the sidecar token does not cover the
    request's ``cache_salt``) is one line, once per distinct refusal: it repeats for
    every request of that salt. Anything else is unexpected: a warning with its
    traceback."""
    if isinstance(exc, PermissionDeniedError):
        text = str(exc)
        if text not in _REFUSALS_SEEN and len(_REFUSALS_SEEN) < 256:
            _REFUSALS_SEEN.add(text)
            logger.warning("lmtier: %s refused (a miss for every such request): %s", what, text)
        return
    logger.warning("lmtier: %s failed", what, exc_info=exc)
