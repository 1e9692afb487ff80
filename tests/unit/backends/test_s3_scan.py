"""The cursor of ``S3Tier.contains`` (lmtier_backends.s3.io.Scan), without S3: how
many HEADs it hands out, whatever order their answers come in."""

from __future__ import annotations

import threading

from lmtier.testing import random_key
from lmtier_backends.s3.io import SCAN_AHEAD_WINDOWS, Scan


def scan_of(count: int, window: int, max_window: int) -> Scan:
    return Scan([random_key() for _ in range(count)], count, window, max_window, [None] * count)


def test_slow_start_widens_the_window_one_per_hit() -> None:
    scan = scan_of(100, 2, 4)
    assert [scan.take(), scan.take()] == [0, 1]  # two in flight: a third must wait
    scan.finish(0, True)  # one answered and a hit: room for two more
    assert [scan.take(), scan.take()] == [2, 3]
    assert scan.window == 3


def test_a_miss_stops_the_cursor_at_it() -> None:
    scan = scan_of(10, 2, 2)
    first, second = scan.take(), scan.take()
    scan.finish(second, False)
    scan.finish(first, True)
    assert scan.take() is None
    assert scan.stop == 1


def test_a_slow_answer_holds_the_cursor_within_reach_of_it() -> None:
    """Key 0's HEAD never answers while every later one answers at once: the cursor
    stops SCAN_AHEAD_WINDOWS windows past it, then moves on once it answers."""
    reach = SCAN_AHEAD_WINDOWS * 2
    scan = scan_of(100, 2, 2)
    assert scan.take() == 0  # and left unanswered
    for expected in range(1, reach):
        assert scan.take() == expected  # one in flight besides key 0: room for more
        scan.finish(expected, True)
    taken: list[int | None] = []
    waiter = threading.Thread(target=lambda: taken.append(scan.take()))
    waiter.start()
    waiter.join(0.5)
    assert taken == []  # out of reach while key 0 is unanswered
    scan.finish(0, True)
    waiter.join(30)
    assert taken == [reach]
    assert scan.base == reach
