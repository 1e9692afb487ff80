"""What the benchmark scripts share: timing, and contention for the CPUs.

Each script still measures its own physical baseline. Under ``--contend N`` it runs
every path, the baseline's included, beside ``N`` processes that each spin on a core
(an inference engine keeps the machine this busy: tokenizers, the scheduler, the
forward pass), so a ratio under contention compares lmtier with the raw I/O it
wraps under the same load, in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

__all__ = ["add_contend_argument", "contend", "contention_of", "median_s", "paired_median_s"]

_SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def add_contend_argument(parser: argparse.ArgumentParser) -> None:
    """``--contend N`` (N spinning processes during the whole run) and its old spelling
    ``--burner`` (one)."""
    parser.add_argument(
        "--contend",
        type=int,
        default=0,
        metavar="N",
        help="N processes spin on the CPUs for the whole run, one per core in turn",
    )
    parser.add_argument("--burner", action="store_true", help="the same as --contend 1")


def contention_of(args: argparse.Namespace) -> int:
    """How many spinners ``args`` asks for (``--contend N``, or 1 for ``--burner``)."""
    count = int(getattr(args, "contend", 0) or 0)
    if count < 0:
        raise SystemExit(f"--contend must be >= 0, got {count}")
    return max(count, 1 if getattr(args, "burner", False) else 0)


@contextlib.contextmanager
def contend(count: int) -> Iterator[None]:
    """``count`` processes spinning while the block runs, each pinned to one of the
    CPUs this process may use, in turn (the last CPU first: the one the old single
    burner took). Nothing when ``count`` is 0. Stopped by their pids on the way out."""
    cpus = sorted(os.sched_getaffinity(0), reverse=True)
    spinners = [
        subprocess.Popen([sys.executable, "-c", _SPIN, str(cpus[i % len(cpus)])])
        for i in range(max(0, count))
    ]
    try:
        if spinners:
            time.sleep(0.2)  # the spinners are running before the first measurement
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after one untimed warm-up run
    (first touches, imports and lazy initialisation are not what we measure)."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def paired_median_s(
    baseline: Callable[[], object], measured: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Median wall times of ``baseline()`` and ``measured()``, run alternately, so that a
    noisy machine slows both alike: their ratio is the figure to read. Which runs first
    alternates too, and each timed call follows an untimed call of its own: what one
    leaves behind must fall on neither. (torch's idle OpenMP threads spin for some
    milliseconds after a parallel region, taking a core from whatever runs next: on 2
    cores a 128 MiB copy through lmtier's threads ran 10 ms alone and 13-16 ms right
    after a torch ``copy_``; the other way, a torch copy runs faster right after
    another, its threads still awake.)"""
    first: list[float] = []
    second: list[float] = []
    for round_ in range(repeats):
        pairs = ((baseline, first), (measured, second))
        for fn, samples in pairs if round_ % 2 == 0 else pairs[::-1]:
            fn()  # untimed: the timed call below follows one of its own kind
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return statistics.median(first), statistics.median(second)
