"""Admission: the concurrency limit, its FIFO wait queue and per-tenant caps, no sockets."""

from __future__ import annotations

import asyncio
import math

import pytest

from router.config import LimitsConfig
from router.dispatch.admission import Admission, LocalCounts
from router.errors import Overloaded
from router.metrics import Metrics


def _limits(**kw) -> LimitsConfig:
    return LimitsConfig(**{"max_concurrent_requests": 2, "queue_size": 1, **kw})


async def test_waits_in_the_queue_then_takes_the_freed_slot() -> None:
    adm = Admission(_limits())
    await adm.enter(None)
    await adm.enter(None)
    waiting = asyncio.create_task(adm.enter(None))
    await asyncio.sleep(0)
    assert (adm.active, adm.queued) == (2, 1)
    with pytest.raises(Overloaded) as info:  # the queue is full
        await adm.enter(None)
    assert info.value.status == 503 and info.value.retry_after == 1
    assert info.value.drop_reason == "queue_full"
    adm.leave(None)
    await waiting
    assert (adm.active, adm.queued) == (2, 0)  # the slot changed hands
    adm.leave(None)
    adm.leave(None)
    assert adm.active == 0


async def test_a_wait_that_times_out_is_a_503() -> None:
    adm = Admission(_limits(max_concurrent_requests=1, queue_timeout=0.05))
    await adm.enter(None)
    with pytest.raises(Overloaded, match="timed out"):
        await adm.enter(None)
    assert (adm.active, adm.queued) == (1, 0)


@pytest.mark.parametrize(
    "handed_first", [False, True], ids=["cancel-then-free", "free-then-cancel"]
)
async def test_a_waiter_that_gives_up_leaks_nothing(handed_first: bool) -> None:
    """Cancelled before or after a slot was handed to it: the slot goes to the next."""
    adm = Admission(_limits(max_concurrent_requests=1, queue_size=4))
    await adm.enter(None)
    gives_up, next_one = (asyncio.create_task(adm.enter(None)) for _ in range(2))
    await asyncio.sleep(0)
    if handed_first:
        adm.leave(None)
        gives_up.cancel()
    else:
        gives_up.cancel()
        adm.leave(None)
    await asyncio.gather(gives_up, return_exceptions=True)
    await next_one
    assert gives_up.cancelled()
    assert (adm.active, adm.queued) == (1, 0)
    adm.leave(None)
    assert adm.active == 0


async def test_tenant_cap_refuses_at_once_and_is_given_back() -> None:
    counts = LocalCounts()
    adm = Admission(_limits(max_concurrent_requests=10, max_concurrent_per_tenant=1), counts)
    held = await adm.enter("acme")
    with pytest.raises(Overloaded, match="acme"):
        await adm.enter("acme")
    other = await adm.enter("globex")
    assert (held.key, other.key) == ("acme", "globex")
    adm.leave(held)
    adm.leave(await adm.enter("acme"))
    adm.leave(other)
    assert adm.active == 0 and counts._counts == {}


async def test_a_cap_set_by_reload_in_between_does_not_unbalance() -> None:
    counts = LocalCounts()
    adm = Admission(_limits(max_concurrent_requests=10), counts)
    held = await adm.enter("acme")  # no cap: nothing held
    adm.configure(_limits(max_concurrent_requests=10, max_concurrent_per_tenant=1))
    adm.leave(held)
    assert counts._counts == {} and adm.active == 0


async def test_raising_the_limit_admits_waiters() -> None:
    adm = Admission(_limits(max_concurrent_requests=1, queue_size=2))
    await adm.enter(None)
    waiters = [asyncio.create_task(adm.enter(None)) for _ in range(2)]
    await asyncio.sleep(0)
    adm.configure(_limits(max_concurrent_requests=3, queue_size=2))
    await asyncio.gather(*waiters)
    assert (adm.active, adm.queued) == (3, 0)


def _refusals(metrics: Metrics) -> dict[str, float]:
    (family,) = metrics.admission_rejections.collect()
    return {s.labels["reason"]: s.value for s in family.samples}


async def test_each_refusal_is_counted_by_its_reason_and_the_queue_depth_follows() -> None:
    metrics = Metrics(list)
    limits = _limits(max_concurrent_requests=1, max_concurrent_per_tenant=1, queue_timeout=0.05)
    adm = Admission(limits, LocalCounts(), metrics)

    def depth() -> float:
        (family,) = metrics.admission_queue.collect()
        return family.samples[0].value

    held = await adm.enter("acme")
    with pytest.raises(Overloaded):
        await adm.enter("acme")  # tenant_cap
    waiting = asyncio.create_task(adm.enter(None))
    await asyncio.sleep(0)
    assert depth() == 1
    with pytest.raises(Overloaded):
        await adm.enter(None)  # queue_full
    with pytest.raises(Overloaded):
        await waiting  # queue_timeout
    assert depth() == 0
    adm.leave(held)
    assert _refusals(metrics) == {
        "saturated": 0, "queue_full": 1, "queue_timeout": 1, "tenant_cap": 1, "shed": 0
    }  # fmt: skip


class _Room:
    """The fleet's room as admission sees it, set by the test."""

    def __init__(self, free: float = 0, reserve: int = 0, slots: int = 0) -> None:
        self.room, self.kept, self.count = free, reserve, slots
        self.probing = 0

    def free(self, enough: float = 1, probe: bool = False) -> float:
        return self.room + (self.probing if probe else 0)

    def full(self) -> bool:
        return self.room <= 0

    def reserve(self) -> int:
        return self.kept

    def slots(self) -> int:
        return self.count


async def _queued(adm: Admission, *tenants: str) -> list[asyncio.Task]:
    """Each of `tenants` enters in turn, and waits."""
    tasks = []
    for tenant in tenants:
        tasks.append(asyncio.create_task(adm.enter(tenant)))
        await asyncio.sleep(0)
    assert adm.queued == len(tenants)
    return tasks


async def test_a_backlog_held_by_a_fleet_of_unknown_bounds_is_released_one_at_a_time() -> None:
    """A released request counts on its backend only once its task runs: where no
    backend's batch limit is known, the backlog must not all go the moment one backend
    leaves saturation."""
    room = _Room()
    adm = Admission(_limits(max_concurrent_requests=10, queue_size=8), room=room)
    waiters = await _queued(adm, "", "", "")
    assert adm.active == 0
    room.room = math.inf
    for released in (1, 2, 3):
        adm.configure(adm.limits)  # as each poll does
        assert (adm.active, adm.queued) == (released, 3 - released)
    await asyncio.gather(*waiters)
    for _ in waiters:
        adm.leave(None)
    assert adm.active == 0


async def test_known_room_releases_as_many_as_fit_counting_the_released() -> None:
    room = _Room()
    adm = Admission(_limits(max_concurrent_requests=10, queue_size=8), room=room)
    waiters = await _queued(adm, "a", "b", "c")
    room.room = 2
    adm.configure(adm.limits)
    assert (adm.active, adm.queued) == (2, 1)  # the released, not yet on a backend, count
    adm.configure(adm.limits)
    assert (adm.active, adm.queued) == (2, 1)
    room.room = 3  # a third backend slot frees
    adm.configure(adm.limits)
    assert (adm.active, adm.queued) == (3, 0)
    await asyncio.gather(*waiters)


async def test_a_tenant_under_its_share_goes_past_a_backlog_into_the_reserve() -> None:
    """A request of a tenant under its share of the fleet's slots is admitted at once
    while the fleet has room, and the last `reserve` slots are kept for such requests:
    the tenant over its share waits."""
    room = _Room(slots=2)  # two tenants present: one slot each, two with the burst
    adm = Admission(_limits(max_concurrent_requests=10, queue_size=8), room=room)
    noisy = await _queued(adm, "noisy", "noisy", "noisy")
    room.room, room.kept = 1, 2
    adm.configure(adm.limits)  # none under its share came yet: no reserve, one goes
    await noisy[0]
    assert (adm.active, adm.queued) == (1, 2)
    quiet = await adm.enter("quiet")  # at once, past noisy's two
    assert (adm.active, adm.queued) == (2, 2)
    adm.configure(adm.limits)  # the room left is the reserve's: noisy waits
    assert adm.queued == 2
    room.room = 3
    adm.configure(adm.limits)  # room past the reserve: one more of noisy's goes
    assert (adm.active, adm.queued) == (3, 1)
    await noisy[1]
    room.room = 1
    second = asyncio.create_task(adm.enter("quiet"))  # noisy waits: queued behind it
    await asyncio.sleep(0)
    assert adm.queued == 2
    adm.leave(quiet)  # its slot goes to quiet's waiter, under its share, not noisy's
    assert (await second).tenant == "quiet" and adm.queued == 1
    room.room = math.inf
    adm.configure(adm.limits)
    await noisy[2]


async def test_a_probe_past_a_limit_goes_to_a_backlog_and_not_while_the_reserve_is_wanted() -> None:
    """A probe's request waits in its backend's own queue and takes the next slot freed
    there: it goes to a backlog, and none goes while requests the reserve is for come."""
    room = _Room(slots=2)
    adm = Admission(_limits(max_concurrent_requests=10, queue_size=8), room=room)
    noisy = await _queued(adm, "noisy", "noisy", "noisy")
    room.kept, room.probing = 1, 1
    adm.configure(adm.limits)  # no room but a probe, and no one the reserve is for
    assert (adm.active, adm.queued) == (1, 2)
    await noisy[0]  # the backlog's first took the probe
    quiet = asyncio.create_task(adm.enter("quiet"))  # under its share: wants the reserve
    await asyncio.sleep(0)
    adm.configure(adm.limits)
    assert (adm.active, adm.queued) == (1, 3)  # no probe now: quiet waits for real room
    room.room = 1
    adm.configure(adm.limits)
    await quiet  # the real room goes to the one the reserve is for
    assert adm.queued == 2
    room.probing, room.room = 0, math.inf
    adm.configure(adm.limits)
    adm.configure(adm.limits)
    await asyncio.gather(*noisy)


async def test_a_class_above_a_waiting_one_keeps_up_to_twice_the_reserve() -> None:
    """A higher class at a steady rate needs more kept slots than a quiet tenant, and
    the lower class waiting is the one to refuse first: up to twice the reserve (here
    10 of 16 slots) is kept while such requests come."""
    room = _Room(slots=16)
    adm = Admission(_limits(max_concurrent_requests=100, queue_size=64), room=room)
    low = [asyncio.create_task(adm.enter("bulk", "sheddable")) for _ in range(20)]
    await asyncio.sleep(0)  # twenty waiting: far over its share
    room.room, room.kept = 10, 5
    for _ in range(40):  # arrivals at the rate of completions: all it may keep
        adm._drain.left()
    for _ in range(40):
        await adm.enter("chat", "critical")  # each past the sheddable waiters
    adm.configure(adm.limits)
    assert adm.queued == 20  # 10 free, 10 kept (twice 5): the sheddable ones wait
    room.room = 11
    adm.configure(adm.limits)
    assert adm.queued == 19
    room.room = math.inf
    adm.configure(adm.limits)
    await asyncio.gather(*low)


async def test_a_tenant_alone_is_not_held_back_by_the_reserve() -> None:
    room = _Room(slots=2)
    adm = Admission(_limits(max_concurrent_requests=10, queue_size=8), room=room)
    waiters = await _queued(adm, "only", "only", "only")
    room.room, room.kept = 2, 2
    adm.configure(adm.limits)
    assert (adm.active, adm.queued) == (2, 1)  # the whole room, reserve or not
    room.room = math.inf
    adm.configure(adm.limits)
    await asyncio.gather(*waiters)
