"""The loop of ``lmtier warm``: read prompts, skip what is cached, warm the rest.

Idempotent and resumable by construction, with no journal to keep: before a prompt
is computed or fetched, one lookup asks how many of its chunks are cached, and a
prompt whose every full chunk is cached is skipped. So a second run does nothing
(but lookups), and a run interrupted (SIGINT) continues where it stopped: what the
first stored is found, what it had not stored yet is warmed, and nothing is lost,
since the cache is flushed and closed on the way out, interrupted or not.

Prompts shorter than one chunk are skipped too: no full chunk, nothing to cache.

Modes (:class:`Warm`): ``model`` computes the KV with a local model
(:mod:`.compute`, through a :class:`Warmer`), ``prefetch`` pulls chunks already in a
shared tier (Redis, S3) into this node's tiers (``LMTier.prefetch_keys``), and ``via``
sends each prompt to a running engine (:mod:`.via`: the engine computes and saves its
own KV). With ``pin``, the chunks of every prompt warmed or found cached are pinned at
the end (``LMTier.pin_keys``: exempt from LRU eviction within the tiers' pin caps).

The tokenizer and the model are asked for only when a prompt needs them (a text
prompt; one not all cached), so a run with nothing to do loads neither. This module
imports no torch: ``--via`` needs none.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import LMTierError
from lmtier_apps.warm.inputs import Prompt, PromptError, check_length, tokenize
from lmtier_apps.warm.interrupt import Interrupt
from lmtier_apps.warm.progress import Progress, Tally
from lmtier_apps.warm.via import EngineClient, EngineUnavailable

if TYPE_CHECKING:
    from lmtier.api import LMTier

__all__ = ["PIN_BATCH", "Warm", "WarmItem", "Warmer", "warm_via"]

PIN_BATCH = 4096
"""Keys pinned per call at the end of a run."""
GIVE_UP_AFTER = 8
"""``--via`` stops when this many prompts in a row fail the same way before any was
warmed (a wrong API key, a wrong model name): the rest would only fail too."""


@dataclass(slots=True)
class WarmItem:
    """One prompt to compute: its token ids, chunk keys, and how many leading chunks
    the cache holds already (from the lookup that decided it needs warming)."""

    tokens: list[int]
    keys: Sequence[ChunkKey]
    cached_chunks: int
    stored_chunks: int = 0
    computed_tokens: int = 0


class Warmer(Protocol):
    """What computes and stores prompts' KV (:class:`.compute.ModelWarmer`, or one
    that loads its model on the first batch): ``batch_size`` items at a time."""

    batch_size: int

    def warm(self, items: Sequence[WarmItem], cache_salt: str = "") -> None:
        """Compute and store every item (``stored_chunks``, ``computed_tokens`` set)."""


@dataclass
class Warm:
    """One warm-up run into ``cache`` (embedded tiers or a sidecar client)."""

    cache: LMTier
    tokenizer: Callable[[], Any] | None
    """Gives the tokenizer, asked only for a prompt that is not token ids; None: no
    tokenizer (such prompts are reported)."""
    tally: Tally
    progress: Progress
    warmer: Warmer | None = None
    """Set for ``model`` mode; None with ``prefetch``."""
    cache_salt: str = ""
    pin: bool = False
    max_len: int | None = None
    """The model's context: longer prompts are reported, not warmed."""
    errors: TextIO = field(default_factory=lambda: sys.stderr)
    interrupt: Interrupt = field(default_factory=Interrupt)
    """Checked around each prompt: a SIGINT whose KeyboardInterrupt was lost stops
    the run all the same (:mod:`.interrupt`)."""
    _batch: list[WarmItem] = field(default_factory=list)
    _to_pin: list[ChunkKey] = field(default_factory=list)

    def run(self, prompts: Iterable[Prompt | PromptError]) -> None:
        """Warm every prompt; on KeyboardInterrupt (or a SIGINT recorded by
        ``interrupt``) stop, marking the tally ``interrupted``. Either way flush what
        was stored, pin, count per tier."""
        before = _puts(self.cache)
        started = time.monotonic()
        try:
            for item in prompts:
                self.interrupt.check()
                self._one(item)
                self.progress.update()
                self.interrupt.check()
            self._drain()
            self.interrupt.check()
        except KeyboardInterrupt:
            self.tally.interrupted = True
        finally:
            with self.interrupt.deferred():
                self._finish(before, started)

    def _finish(self, before: dict[str, int], started: float) -> None:
        self.progress.close()
        self.cache.flush()
        self.tally.interrupted = self.tally.interrupted or self.interrupt.received
        if self.pin and not self.tally.interrupted:
            self._pin()
        self.tally.seconds = time.monotonic() - started
        if self.warmer is not None:
            after = _puts(self.cache)
            for tier, count in after.items():
                if count - before.get(tier, 0) > 0:
                    self.tally.chunks_stored[tier] = count - before.get(tier, 0)

    def _one(self, item: Prompt | PromptError) -> None:
        tally = self.tally
        tally.prompts += 1
        keyed = self._keyed(item)
        if keyed is None:
            return
        tokens, keys = keyed
        tally.prompt_tokens += len(tokens)
        # A prefetch is for chunks this node lacks: only its own tiers count as cached.
        local = self.warmer is None
        found = self.cache.lookup_keys(keys, local_only=local).num_chunks if keys else 0
        tally.cached_tokens += found * self.cache.chunk_size
        if self.pin:
            self._to_pin.extend(keys)
        if found == len(keys):
            tally.skipped += 1
        elif self.warmer is None:
            self._prefetch(item.source, keys[found:])
        else:
            self._batch.append(WarmItem(tokens, keys, found))
            if len(self._batch) >= self.warmer.batch_size:
                self._drain()

    def _keyed(self, item: Prompt | PromptError) -> tuple[list[int], list[ChunkKey]] | None:
        """The prompt's token ids and chunk keys; None (reported) for a bad prompt."""
        if isinstance(item, PromptError):
            self._error(str(item))
            return None
        try:
            tokenizer = self.tokenizer() if item.needs_tokenizer and self.tokenizer else None
            tokens = tokenize(item, tokenizer)
            if self.max_len is not None and (
                problem := check_length(tokens, self.max_len, item.source)
            ):
                self._error(str(problem))
                return None
            return tokens, self.cache.keys(tokens, cache_salt=self.cache_salt)
        except LMTierError as exc:  # untokenizable; a token id out of the vocabulary
            message = str(exc)
            self._error(message if message.startswith(item.source) else f"{item.source}: {message}")
            return None

    def _prefetch(self, source: str, keys: list[ChunkKey]) -> None:
        fetched = self.cache.prefetch_keys(keys)
        if not fetched:
            self._error(f"{source}: no tier holds its next chunk: nothing to prefetch")
            return
        for tier, count in fetched.items():
            self.tally.chunks_stored[tier] = self.tally.chunks_stored.get(tier, 0) + count
        self.tally.warmed += 1

    def _drain(self) -> None:
        batch, self._batch = self._batch, []
        if not batch or self.warmer is None:
            return
        self.warmer.warm(batch, self.cache_salt)
        for item in batch:
            self.tally.warmed += 1
            self.tally.computed_tokens += item.computed_tokens
            self.tally.new_chunks += item.stored_chunks

    def _pin(self) -> None:
        keys = list(dict.fromkeys(self._to_pin))
        for start in range(0, len(keys), PIN_BATCH):
            for tier, count in self.cache.pin_keys(keys[start : start + PIN_BATCH]).items():
                if count >= 0:
                    self.tally.pinned[tier] = self.tally.pinned.get(tier, 0) + count

    def _error(self, line: str) -> None:
        self.tally.error(line)
        print(f"lmtier warm: {line}", file=self.errors, flush=True)


def warm_via(
    client: EngineClient,
    prompts: Iterable[Prompt | PromptError],
    tally: Tally,
    progress: Progress,
    *,
    concurrency: int,
    errors: TextIO | None = None,
    interrupt: Interrupt | None = None,
) -> None:
    """``--via``: send every prompt to the engine, ``concurrency`` at a time (an engine
    with lmtier answers an already-cached prompt from its cache, so a rerun is cheap).
    Bad input lines and failed prompts are printed and counted; KeyboardInterrupt (or
    a SIGINT recorded by ``interrupt``) stops the run, marking the tally ``interrupted``."""
    stream = errors or sys.stderr
    stop = interrupt or Interrupt()

    def report(line: str) -> None:
        tally.error(line)
        print(f"lmtier warm: {line}", file=stream, flush=True)

    started = time.monotonic()
    results = client.warm_all(_good(prompts, tally, report, stop), concurrency)
    same: list[str] = []  # the last failures, while they are all the same
    try:
        for result in results:
            stop.check()
            if result.error is not None:
                report(f"{result.source}: {result.error}")
                error = result.error
                same = [*same, error] if same[-1:] in ([], [error]) else [error]
                if len(same) >= GIVE_UP_AFTER and not tally.warmed:
                    raise EngineUnavailable(
                        f"the engine refused {len(same)} prompts in a row, nothing warmed: "
                        f"{result.error}",
                        url=client.url,
                    )
            else:
                same = []
                tally.warmed += 1
                tally.prompt_tokens += result.prompt_tokens or 0
                cached = result.cached_tokens or 0
                tally.cached_tokens += cached
                tally.computed_tokens += max(0, (result.prompt_tokens or 0) - cached)
            progress.update()
        stop.check()
    except KeyboardInterrupt:
        tally.interrupted = True
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()
        progress.close()
        tally.interrupted = tally.interrupted or stop.received
        tally.seconds = time.monotonic() - started


def _good(
    prompts: Iterable[Prompt | PromptError],
    tally: Tally,
    report: Callable[[str], None],
    interrupt: Interrupt,
) -> Iterator[Prompt]:
    for item in prompts:
        interrupt.check()
        tally.prompts += 1
        if isinstance(item, PromptError):
            report(str(item))
        else:
            yield item


def _puts(cache: LMTier) -> dict[str, int]:
    """Chunks each tier has stored so far (its ``puts`` counter)."""
    out: dict[str, int] = {}
    for tier, entry in cache.stats().items():
        puts = entry.get("puts")
        if isinstance(puts, (int, float)):
            out[tier] = int(puts)
    return out
