"""How a backend's own exceptions become lmtier's, and how a batch's failures settle.

Each backend declares one :class:`ExceptionMap`: an ordered table from its foreign
exceptions (redis-py's, botocore's, OSError) to the :class:`~lmtier.errors.BackendError`
each becomes, and whether it says the whole tier is failing (a refused connection, a
timeout, a 5xx) or only that one item (a 403 on one object). It is used at every
edge of the backend, so one exception always means the same thing (httpx's
``map_httpcore_exceptions`` is the model). An exception no rule names is a bug and
propagates unchanged.

:func:`settle` is the one rule every backend applies to a batch's outcomes: if no
item got an answer and some failure was the tier's, the batch raises it (a timeout
first), so the StorageManager's breaker sees an outage, and the manager counts the
failed call; otherwise each failed item is a miss (or an unstored chunk), counted in
``stats.errors`` and logged by :class:`FailureLog`: WARNING the first time a kind of
failure is seen, DEBUG after, so a dead disk or a flapping server cannot flood logs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lmtier.errors import BackendError, BackendTimeout, BackendUnavailable
from lmtier.storage.stats import TierStats

__all__ = ["ExceptionMap", "Failure", "FailureLog", "Rule", "settle"]

logger = logging.getLogger(__name__)

TierLevel = bool | Callable[[BaseException], bool]


@dataclass(frozen=True, slots=True)
class Rule:
    """Exceptions of ``types`` become ``becomes``; ``tier_level`` (or a predicate on the
    exception) says whether they mean the whole tier is failing."""

    types: tuple[type[BaseException], ...]
    becomes: type[BackendError]
    tier_level: TierLevel


@dataclass(frozen=True, slots=True)
class Failure:
    """One call or item that got no usable answer: lmtier's error (``from`` the foreign
    one) and whether it says the tier is failing."""

    error: BackendError
    tier_level: bool


class ExceptionMap:
    """One backend's translation table (module docstring). ``where`` names the tier in
    messages (``"redis tier 'redis' at redis://h:6379/0"``; never a secret)."""

    __slots__ = ("rules", "where")

    def __init__(self, where: str, rules: Sequence[Rule]) -> None:
        self.where = where
        self.rules = tuple(rules)

    def failure(self, exc: BaseException, op: str) -> Failure:
        """``exc`` (raised by ``op``) as lmtier's; re-raises an exception no rule names."""
        if isinstance(exc, BackendError):  # raised by lmtier's own code in the backend
            return Failure(exc, isinstance(exc, (BackendUnavailable, BackendTimeout)))
        for rule in self.rules:
            if isinstance(exc, rule.types):
                detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                verb = "timed out" if rule.becomes is BackendTimeout else "failed"
                error = rule.becomes(f"{self.where}: {op} {verb} ({detail})")
                error.__cause__ = exc  # as `raise error from exc` would
                tier_level = rule.tier_level(exc) if callable(rule.tier_level) else rule.tier_level
                return Failure(error, tier_level)
        raise exc

    def error(self, exc: BaseException, op: str) -> BackendError:
        """``exc`` as lmtier's error, for a call that fails as a whole."""
        return self.failure(exc, op).error


class FailureLog:
    """Counts a tier's absorbed failures in its stats, and logs each kind once."""

    __slots__ = ("_seen", "name", "stats")

    def __init__(self, name: str, stats: TierStats) -> None:
        self.name = name
        self.stats = stats
        self._seen: set[object] = set()

    def record(self, op: str, what: object, kind: object = None) -> None:
        """One failed item of ``op``; ``kind`` (default: the type of ``what``) says which
        failures are the same for logging."""
        self.stats.errors += 1
        tag = (op, kind if kind is not None else type(what))
        self.warn_once(
            tag, "%s failed: %s (counted in stats.errors; more like it at DEBUG)", op, what
        )

    def warn_once(self, tag: object, msg: str, *args: object) -> None:
        """Log ``msg`` (prefixed with the tier's name) at WARNING the first time ``tag``
        is seen, then at DEBUG."""
        level = logging.DEBUG if tag in self._seen else logging.WARNING
        self._seen.add(tag)
        logger.log(level, "%s: " + msg, self.name, *args)


def settle(log: FailureLog, exceptions: ExceptionMap, op: str, outcomes: Sequence[object]) -> None:
    """Settle a batch's ``outcomes`` (results, exceptions or :class:`Failure`\\ s; module
    docstring): raise when nothing got an answer and the tier is at fault, else count."""
    failures = [
        o if isinstance(o, Failure) else exceptions.failure(o, op)
        for o in outcomes
        if isinstance(o, (BaseException, Failure))
    ]
    if not failures:
        return
    tier_level = [f.error for f in failures if f.tier_level]
    if tier_level and len(failures) == len(outcomes):
        timeouts = [e for e in tier_level if isinstance(e, BackendTimeout)]
        raise (timeouts or tier_level)[0]
    for failure in failures:
        log.record(op, failure.error, (type(failure.error), failure.tier_level))
