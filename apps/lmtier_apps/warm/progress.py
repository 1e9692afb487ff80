"""What ``lmtier warm`` tells the person running it: a live progress bar on a TTY
(prompts, tokens, tokens/s, chunks stored per tier, ETA: ``rich``), nothing while it
runs otherwise (a log or a pipe gets only the summary), and the final summary as a
few lines or, with ``--json``, one JSON object."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from lmtier.ops.render import counted

__all__ = ["Progress", "Tally", "by_tier"]


def by_tier(counts: Mapping[str, int]) -> str:
    """Counts per tier as a summary line shows them: ``cpu 4, disk 4`` (a negative
    count, a tier that failed: ``redis failed``); empty for none."""
    return ", ".join(f"{tier} {n}" if n >= 0 else f"{tier} failed" for tier, n in counts.items())


@dataclass(slots=True)
class Tally:
    """Counts of one warm-up run; ``as_json`` is the ``--json`` summary's schema."""

    mode: str
    prompts: int = 0
    """Prompts read (good and bad)."""
    warmed: int = 0
    """Prompts whose chunks this run stored, sent, or prefetched."""
    skipped: int = 0
    """Prompts already fully cached (one lookup), or shorter than one chunk."""
    failed: int = 0
    """Bad input lines and prompts that failed; each is printed with its source."""
    prompt_tokens: int = 0
    computed_tokens: int = 0
    """Tokens this run prefilled (``--model``) or the engine reported uncached (``--via``)."""
    cached_tokens: int = 0
    """Tokens already cached when their prompt came up."""
    new_chunks: int = 0
    """Chunks this run computed and stored (counted as they are stored)."""
    chunks_stored: dict[str, int] = field(default_factory=dict)
    """Chunks each tier received during the run (its ``puts``, read at the end), or, with
    ``--prefetch``, chunks fetched from it."""
    pinned: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    interrupted: bool = False
    errors: list[str] = field(default_factory=list)
    """The first ``MAX_ERRORS`` problems, one line each."""

    MAX_ERRORS = 100

    def error(self, line: str) -> None:
        self.failed += 1
        if len(self.errors) < self.MAX_ERRORS:
            self.errors.append(line)

    @property
    def tokens_per_s(self) -> float:
        return self.computed_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["tokens_per_s"] = round(self.tokens_per_s, 1)
        out["seconds"] = round(self.seconds, 3)
        out["schema"] = "lmtier.warm/1"
        return out


class Progress:
    """A live bar when ``stream`` is a TTY and ``enabled``; else silent until
    :meth:`summary`. ``total``: prompts expected (None: unknown, no ETA)."""

    def __init__(self, tally: Tally, total: int | None, *, enabled: bool, stream: TextIO) -> None:
        self.tally = tally
        self.stream = stream
        self.started = time.monotonic()
        self._bar: Any = None
        self._task: Any = None
        if enabled and stream.isatty():
            try:
                from rich.progress import (  # noqa: PLC0415 - only on a TTY
                    BarColumn,
                    MofNCompleteColumn,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )
                from rich.progress import Progress as Bar  # noqa: PLC0415
            except ImportError:
                return
            from rich.console import Console  # noqa: PLC0415

            self._bar = Bar(
                TextColumn("[bold]warming"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(file=stream),
                transient=True,
            )
            self._task = self._bar.add_task("warm", total=total, detail="")
            self._bar.start()

    def update(self) -> None:
        """Redraw from the tally (cheap; call after each prompt)."""
        if self._bar is None:
            return
        tally = self.tally
        seconds = time.monotonic() - self.started
        rate = tally.computed_tokens / seconds if seconds > 0 else 0.0
        stored = " ".join(f"{t}:{n}" for t, n in tally.chunks_stored.items() if n)
        if tally.new_chunks:
            stored = f"stored {tally.new_chunks:,} chunks {stored}"
        detail = (
            f"{tally.prompt_tokens:,} tok  {rate:,.0f} tok/s  skipped {tally.skipped}  "
            f"failed {tally.failed}  {stored}"
        )
        self._bar.update(self._task, completed=tally.prompts, detail=detail)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def summary(self, *, as_json: bool, out: TextIO | None = None) -> None:
        """Print the final summary: JSON on stdout, or lines on stderr."""
        self.close()
        tally = self.tally
        if as_json:
            print(json.dumps(tally.as_json()), file=out or sys.stdout, flush=True)
            return
        stream = out or self.stream
        state = "interrupted" if tally.interrupted else "done"
        print(
            f"lmtier warm ({tally.mode}) {state}: {counted(tally.prompts, 'prompt')}, "
            f"{tally.warmed} warmed, {tally.skipped} skipped (cached), {tally.failed} failed; "
            f"{counted(tally.prompt_tokens, 'prompt token')}, {tally.computed_tokens:,} "
            f"computed ({tally.tokens_per_s:,.0f} tok/s), {tally.cached_tokens:,} already "
            f"cached; {tally.seconds:.1f} s",
            file=stream,
        )
        if tally.chunks_stored:
            print(f"  chunks by tier: {by_tier(tally.chunks_stored)}", file=stream)
        if tally.pinned:
            print(f"  pinned by tier: {by_tier(tally.pinned)}", file=stream)
        stream.flush()
