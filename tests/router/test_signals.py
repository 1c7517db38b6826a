"""The flow signals: each worker writes its own column, a reader combines them."""

from __future__ import annotations

from array import array

import pytest

from router.dispatch.signals import LEFT, ROWS, WANTED_AT, FlowCells, Rate


def _workers(n: int) -> list[FlowCells]:
    words = array("q", bytes(8 * ROWS * n))
    return [FlowCells(words, n, w) for w in range(n)]


def test_rates_are_read_for_one_worker_or_summed_for_the_router() -> None:
    a, b = _workers(2)
    mine, theirs = Rate(a, LEFT), Rate(b, LEFT)
    for _ in range(3):
        mine.count()
    theirs.count()
    assert 1.5 <= mine.per_second() <= 3 and 0.5 <= theirs.per_second() <= 1
    assert mine.everywhere() == pytest.approx(theirs.everywhere(), rel=0.01)
    assert 2 <= mine.everywhere() <= 4


def test_weights_are_the_largest_workers_and_moments_the_latest() -> None:
    a, b, c = _workers(3)
    a.set_weights(1.5)
    b.set_weights(2.25)
    assert c.weights() == 2.25
    assert c.since(WANTED_AT) > 1  # never marked: long ago
    b.mark(WANTED_AT)
    assert a.since(WANTED_AT) < 1 and c.since(WANTED_AT) < 1
