"""What the benchmark scripts share: timing. (Each script still measures its own baseline.)"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


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
    """Median wall times of ``baseline()`` and ``measured()``, run alternately (after one
    untimed warm-up each), so that a noisy machine slows both alike: their ratio is the
    figure to read."""
    baseline()
    measured()
    first: list[float] = []
    second: list[float] = []
    for _ in range(repeats):
        for fn, samples in ((baseline, first), (measured, second)):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return statistics.median(first), statistics.median(second)
