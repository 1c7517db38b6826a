"""The shared admission table: a cap held across workers' columns, counts given back,
tenants sharing a slot sharing its cap, a dead worker's column zeroed; and Admission
over it (several tables on one file stand for the workers)."""

from __future__ import annotations

import asyncio
import math

import pytest

from router.config import FlowClassConfig, FlowConfig, LimitsConfig
from router.dispatch.admission import Admission
from router.dispatch.shared_admission import TENANT_SLOTS, TOTAL, AdmissionTable
from router.errors import Overloaded
from tests.router.test_admission import _queued, _Room


def tables(tmp_path, workers: int = 3) -> list[AdmissionTable]:
    return [AdmissionTable(tmp_path / "admission", workers, w) for w in range(workers)]


def test_a_cap_holds_across_every_workers_column(tmp_path) -> None:
    t0, t1, t2 = tables(tmp_path)
    assert [t.take(TOTAL, 4) for t in (t0, t1, t2, t0)] == [True] * 4
    assert not t1.take(TOTAL, 4) and not t2.take(TOTAL, 4)  # refused: nothing kept
    t0.give(TOTAL)
    assert t2.take(TOTAL, 4)
    assert not t0.take(TOTAL, 4)


def test_tenants_are_counted_apart_and_a_shared_slot_shares_its_cap(tmp_path) -> None:
    t0, t1, _ = tables(tmp_path)
    a, b = t0.key("tenant-a"), t1.key("tenant-b")
    assert a == t1.key("tenant-a") and a != b and 1 <= a <= TENANT_SLOTS
    assert t0.take(a, 1) and t1.take(b, 1)
    assert not t1.take(a, 1)
    twin = next(f"t{i}" for i in range(10 * TENANT_SLOTS) if t0.key(f"t{i}") == a)
    assert not t1.take(t1.key(twin), 1)  # a collision refuses early, never admits more
    t0.give(a)
    assert t1.take(t1.key(twin), 1)


def test_a_dead_workers_column_is_zeroed(tmp_path) -> None:
    t0, t1, _ = tables(tmp_path)
    supervisor = AdmissionTable(tmp_path / "admission", 3, None)
    tenant = t0.key("tenant-a")
    assert t0.take(TOTAL, 2) and t0.take(TOTAL, 2) and t0.take(tenant, 1)
    assert not t1.take(TOTAL, 2) and not t1.take(tenant, 1)
    supervisor.clear_worker(0)
    assert t1.take(TOTAL, 2) and t1.take(tenant, 1)


def _limits(**kw) -> LimitsConfig:
    return LimitsConfig(**{"max_concurrent_requests": 1, "queue_size": 1, **kw})


async def test_a_waiter_takes_a_slot_freed_in_another_worker(tmp_path) -> None:
    t0, t1, _ = tables(tmp_path)
    first, second = Admission(_limits(), t0), Admission(_limits(), t1)
    await first.enter(None)
    waiting = asyncio.create_task(second.enter(None))
    await asyncio.sleep(0)
    assert second.queued == 1
    first.leave(None)  # no waiter in its own worker: the slot goes back to the table
    await asyncio.wait_for(waiting, 5)  # found by the waiter's poll
    assert (first.active, second.active) == (0, 1)
    with pytest.raises(Overloaded, match="Tenant `t` is at its limit of 1"):
        per_tenant = _limits(max_concurrent_requests=10, max_concurrent_per_tenant=1)
        first.configure(per_tenant)
        second.configure(per_tenant)
        await second.enter("t")
        await first.enter("t")


def test_session_records_and_waiters_by_class_are_seen_by_every_worker(tmp_path) -> None:
    t0, t1, t2 = tables(tmp_path)
    key = (1 << 64) - 12345  # an xxh3 digest above int64's range
    assert t1.recall(key) is None
    t0.sessions.record(key, 0xDEADBEEF, 1234.9)
    assert t1.sessions.recall(key) == (0xDEADBEEF, 1234.0)
    assert t2.recall(key + 1) is None  # another session, another slot
    t1.set_waiting(0, 2)  # worker 1 has two critical waiters
    assert t0.waiting_above(1) and t2.waiting_above(2) and not t1.waiting_above(1)
    assert not t0.waiting_above(0)  # nothing is above the top class
    t2.clear_worker(1)  # it died: its waiters went with it, the sessions stay
    assert not t0.waiting_above(1)
    assert t2.recall(key) == (0xDEADBEEF, 1234.0)


async def test_the_reserve_and_the_shares_count_every_workers_requests(tmp_path) -> None:
    """A quiet tenant's request in worker 1 beside a noisy tenant's backlog in worker 0:
    worker 0 keeps the fleet's last slots for such requests though none came to it, and
    worker 1 judges noisy over its share by its requests in every worker."""
    t0, t1, _ = tables(tmp_path)
    room = _Room(free=1, reserve=2, slots=4)
    limits = _limits(max_concurrent_requests=20, queue_size=8)
    first, second = Admission(limits, t0, room=room), Admission(limits, t1, room=room)
    held = [await second.enter("noisy")]  # a tenant's connections spread over workers
    room.room = 0
    backlog = await _queued(first, "noisy", "noisy", "noisy", "noisy")
    room.room = 1
    held.append(await second.enter("quiet"))  # under its share: the reserve's, at once
    late = asyncio.create_task(second.enter("noisy"))  # over its share router-wide
    await asyncio.sleep(0)
    assert second.queued == 1
    first.configure(limits)  # as a poll does: the one slot is the reserve's
    assert (first.active, first.queued) == (0, 4)
    room.room = math.inf
    for _ in range(5):  # a backlog is released a poll at a time
        first.configure(limits)
        second.configure(limits)
    for one in await asyncio.gather(*backlog):
        first.leave(one)
    for one in [*held, await late]:
        second.leave(one)
    assert first.active == second.active == 0


async def test_a_slot_released_in_one_worker_is_not_handed_out_again_by_another(tmp_path) -> None:
    """A waiter released in worker 0 counts on no backend until its task runs: worker 1
    must not see that slot as free meanwhile."""
    t0, t1, _ = tables(tmp_path)
    room = _Room(free=0, slots=4)
    limits = _limits(max_concurrent_requests=20, queue_size=8)
    first, second = Admission(limits, t0, room=room), Admission(limits, t1, room=room)
    (waiter,) = await _queued(first, "a")
    room.room = 1
    late = asyncio.create_task(second.enter("b"))  # runs before the released waiter
    first.configure(limits)  # released: its task has not run yet
    await asyncio.sleep(0)
    assert second.queued == 1  # the one free slot was worker 0's waiter's
    first.leave(await waiter)
    second.configure(limits)
    second.leave(await late)


async def test_a_higher_class_waiting_in_one_worker_goes_before_a_lower_one_in_another(
    tmp_path,
) -> None:
    """The class order holds across workers: a slot freed while worker 0 has a critical
    waiter is not taken by worker 1's standard waiters, nor by a standard request
    arriving there, though worker 1 polls first."""
    t0, t1, _ = tables(tmp_path)
    room = _Room(free=0, slots=4)
    limits = _limits(max_concurrent_requests=20, queue_size=8)
    first, second = Admission(limits, t0, room=room), Admission(limits, t1, room=room)
    critical = asyncio.create_task(first.enter("a", "critical"))
    (standard,) = await _queued(second, "b")
    assert (first.queued, second.queued) == (1, 1)
    room.room = 1
    second.configure(limits)  # worker 1's poll: its waiter is below worker 0's
    late = asyncio.create_task(second.enter("c"))
    await asyncio.sleep(0)
    assert (first.queued, second.queued) == (1, 2)
    first.configure(limits)
    held = await asyncio.wait_for(critical, 5)
    room.room = math.inf
    second.configure(limits)
    for one in await asyncio.wait_for(asyncio.gather(standard, late), 5):
        second.leave(one)
    first.leave(held)
    assert first.active == second.active == 0


async def test_a_waiter_past_max_wait_goes_before_another_workers_higher_class(tmp_path) -> None:
    """Promotion holds across workers: worker 1's standard waiter, past its `max_wait`
    (0 here), takes the slot freed while worker 0 keeps a critical waiter, as it would
    in one worker's queue; so nothing starves behind another worker's higher class."""
    t0, t1, _ = tables(tmp_path)
    room = _Room(free=0, slots=4)
    limits = _limits(max_concurrent_requests=20, queue_size=8)
    flow = FlowConfig(classes={"standard": FlowClassConfig(max_wait=0.0)})
    first = Admission(limits, t0, room=room, flow=flow)
    second = Admission(limits, t1, room=room, flow=flow)
    critical = asyncio.create_task(first.enter("a", "critical"))
    (standard,) = await _queued(second, "b")
    room.room = 1
    second.configure(limits, flow)
    held = await asyncio.wait_for(standard, 5)
    assert (first.queued, second.queued, second.active) == (1, 0, 1)
    room.room = math.inf
    first.configure(limits, flow)
    first.leave(await asyncio.wait_for(critical, 5))
    second.leave(held)
