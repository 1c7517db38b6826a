"""A backend's batch limit as learned from its scrapes (router/fleet/batch_limit.py)."""

from __future__ import annotations

import pytest

from router.fleet import batch_limit
from router.fleet.batch_limit import BatchLimit


def _at_limit(running: int) -> BatchLimit:
    """A limit learned at `running`: two scrapes in a row find requests waiting."""
    limit = BatchLimit()
    for _ in range(2):
        limit.observe(running=running, waiting=1, inflight=running + 1)
    return limit


@pytest.fixture
def now(monkeypatch) -> list[float]:
    clock = [1000.0]
    monkeypatch.setattr(batch_limit.time, "monotonic", lambda: clock[0])
    return clock


def test_two_queueing_scrapes_not_growing_learn_the_most_run_lately(now) -> None:
    """vLLM admits a request at its next step: a scrape between two steps finds one
    waiting beside a batch with room, and a filling batch shows some waiting at each
    size. The limit is the most it ran lately, once the batch stops growing."""
    limit = BatchLimit()
    limit.observe(running=4, waiting=0, inflight=4)
    assert limit.slots is None  # nothing waiting: no limit seen
    limit.observe(running=3, waiting=1, inflight=4)
    assert limit.slots is None  # one waiting may be a request between two steps
    limit.observe(running=5, waiting=1, inflight=6)
    assert limit.slots is None  # the batch still grows
    limit.observe(running=4, waiting=2, inflight=6)
    assert limit.slots == 5
    now[0] += 2 * batch_limit.WINDOW_SECONDS  # the peak's window passed
    limit.observe(running=3, waiting=1, inflight=4)
    limit.observe(running=3, waiting=1, inflight=4)
    assert limit.slots == 3


def test_more_running_than_the_limit_raises_it_and_less_keeps_it(now) -> None:
    limit = _at_limit(4)
    limit.observe(running=7, waiting=0, inflight=7)
    assert limit.slots == 7
    limit.observe(running=2, waiting=0, inflight=2)
    assert limit.slots == 7


def test_held_at_its_limit_a_tenth_more_is_tried_now_and_then(now) -> None:
    limit = _at_limit(40)
    now[0] += batch_limit.PROBE_SECONDS / 2
    limit.observe(running=40, waiting=0, inflight=40)
    assert (limit.slots, limit.probe) == (40, 0)  # not before PROBE_SECONDS at the limit
    now[0] += batch_limit.PROBE_SECONDS / 2
    limit.observe(running=40, waiting=0, inflight=40)
    assert (limit.slots, limit.probe) == (40, 4)  # try for room
    for _ in range(2):
        limit.observe(running=40, waiting=4, inflight=44)
    assert (limit.slots, limit.probe) == (40, 0)  # none
    now[0] += batch_limit.PROBE_SECONDS
    limit.observe(running=40, waiting=0, inflight=40)
    assert limit.probe == 4
    limit.observe(running=43, waiting=0, inflight=43)
    assert (limit.slots, limit.probe) == (43, 0)  # room found: the limit is theirs
    for small in range(1, 3):  # at least one more
        limit = _at_limit(small)
        now[0] += batch_limit.PROBE_SECONDS
        limit.observe(running=small, waiting=0, inflight=small)
        assert limit.probe == 1


def test_a_limit_is_kept_below_it_and_forgotten_with_stale_metrics(now) -> None:
    limit = _at_limit(4)
    now[0] += 10 * batch_limit.WINDOW_SECONDS
    limit.observe(running=1, waiting=0, inflight=1)
    assert limit.slots == 4
    limit.forget()
    assert limit.slots is None


def test_the_requests_beyond_the_routers_own_are_others() -> None:
    """Counted when two scrapes in a row find them: one alone may count requests
    that ended between the engine's step and the router's count."""
    limit = BatchLimit()
    limit.observe(running=6, waiting=2, inflight=5)
    assert limit.others == 0
    limit.observe(running=7, waiting=1, inflight=4)
    assert limit.others == 3
    limit.observe(running=3, waiting=0, inflight=5)
    assert limit.others == 0
