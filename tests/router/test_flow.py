"""Flow control's order and rules, no sockets: fair share, promotion, classes."""

from __future__ import annotations

import asyncio

import pytest
from multidict import CIMultiDict

from router.config import (
    FlowClassConfig,
    FlowConfig,
    FlowTenantConfig,
    LimitsConfig,
    SaturationConfig,
)
from router.dispatch.flow import (
    DrainRate,
    FairQueue,
    FlowQueue,
    PriorityRefused,
    Waiter,
    rank_of,
    request_class,
    reserve_for,
)
from router.dispatch.saturation import FleetRoom


def _waiter(tenant: str, priority: str = "standard", since: float = 0.0) -> Waiter:
    return Waiter(tenant, rank_of(priority), asyncio.Future(), since)


def _drain(queue: FairQueue | FlowQueue) -> list[str]:
    out = []
    while (len(queue) if isinstance(queue, FlowQueue) else queue.size) > 0:
        out.append(queue.pop().tenant)
    return out


async def test_fair_queue_releases_weight_to_one_ratio() -> None:
    fair = FairQueue({"big": 3}, 1.0)
    for tenant in ["big"] * 9 + ["small"] * 3:
        fair.push(_waiter(tenant))
    assert _drain(fair) == (["big"] * 3 + ["small"]) * 3


async def test_a_half_weight_tenant_gets_a_turn_every_second_round() -> None:
    fair = FairQueue({"half": 0.5}, 1.0)
    for tenant in ["half"] * 2 + ["one"] * 4:
        fair.push(_waiter(tenant))
    assert _drain(fair) == ["one", "half", "one", "one", "half", "one"]


async def test_a_waiter_past_max_wait_is_promoted_over_a_higher_class() -> None:
    limits = LimitsConfig()
    flow = FlowConfig(classes={"sheddable": FlowClassConfig(max_wait=1.0)})
    queue = FlowQueue(flow, limits)
    queue.push(_waiter("old", "sheddable", since=0.0))  # waiting since long ago
    queue.push(_waiter("young", "sheddable", since=1e12))
    queue.push(_waiter("crit", "critical", since=1e12))
    assert _drain(queue) == ["old", "crit", "young"]


async def test_classes_release_highest_first_and_shed_the_newest_lowest() -> None:
    queue = FlowQueue(FlowConfig(), LimitsConfig())
    for tenant, cls in [("s1", "sheddable"), ("s2", "sheddable"), ("std", "standard")]:
        queue.push(_waiter(tenant, cls, since=float(len(queue))))
    assert queue.lower_than(rank_of("critical")).tenant == "s2"
    assert queue.lower_than(rank_of("sheddable")) is None
    queue.push(_waiter("crit", "critical"))
    assert _drain(queue) == ["crit", "std", "s1", "s2"]


@pytest.mark.parametrize(
    ("tenant", "header", "expected"),
    [
        (None, None, "standard"),
        (None, "sheddable", "sheddable"),  # anyone may lower its class
        ("vip", None, "critical"),
        ("vip", "standard", "standard"),
        ("ops", "critical", "critical"),  # a trusted tenant may raise it
        (None, "critical", PriorityRefused),
        ("vip", "Bogus", PriorityRefused),
    ],
)
def test_request_class(tenant: str | None, header: str | None, expected) -> None:
    flow = FlowConfig(
        tenants={
            "vip": FlowTenantConfig(priority="critical"),
            "ops": FlowTenantConfig(trusted=True),
        }
    )
    headers = CIMultiDict({"x-kvroute-priority": header} if header else {})
    if expected is PriorityRefused:
        with pytest.raises(PriorityRefused) as info:
            request_class(flow, tenant, headers)
        assert info.value.status in (400, 403)
    else:
        assert request_class(flow, tenant, headers) == expected


class _Batch:
    def __init__(self, slots: int | None) -> None:
        self.slots, self.others, self.probe = slots, 0, 0


class _Backend:
    def __init__(
        self,
        waiting: float,
        kv: float,
        inflight: int = 0,
        usable: bool = True,
        slots: int | None = None,
        unstarted: int = 0,
    ) -> None:
        """`unstarted`: the router's requests there whose answer has not begun, all sent
        since the last scrape."""
        self.waiting, self.kv_usage, self.usable = waiting, kv, usable
        self.inflight, self.unstarted, self.unstarted_at_scrape = inflight, unstarted, 0
        self.batch = _Batch(slots)


def _full(backends: list, cfg: SaturationConfig) -> bool:
    return FleetRoom(lambda: backends, lambda: cfg).full()


def test_saturated_only_when_every_usable_backend_is() -> None:
    cfg = SaturationConfig(max_waiting=2, max_kv_cache_usage=0.9)
    full, kv_full = _Backend(3, 0.1), _Backend(0, 0.9)
    assert _full([full, kv_full, _Backend(0, 0, usable=False)], cfg)
    assert not _full([full, _Backend(0, 0.5)], cfg)
    assert _full([full, _Backend(1, 0.5, inflight=2, unstarted=2)], cfg)  # queueing, 2 added
    assert not _full([full, _Backend(0, 0.5, inflight=30)], cfg)  # it batches them
    assert not _full([full, _Backend(0, 0.5, inflight=30, unstarted=2)], cfg)
    # three sent since a scrape that found nothing waiting, none answering yet
    assert _full([full, _Backend(0, 0.5, inflight=30, unstarted=3)], cfg)
    assert not _full([], cfg)  # none usable: routing answers instead
    assert not _full([full], SaturationConfig(enabled=False))


def test_a_learned_batch_limit_bounds_the_room_by_the_routers_own_in_flight() -> None:
    """Once a backend's batch limit is known, its room is that limit plus max_waiting
    less the router's in flight there, whatever its last scrape said."""
    cfg = SaturationConfig(max_waiting=1, reserve=0.25)
    a, b = _Backend(0, 0.1, inflight=4, slots=4), _Backend(0, 0.1, inflight=2, slots=4)
    room = FleetRoom(lambda: [a, b], lambda: cfg)
    assert (room.free(100), room.reserve()) == (1 + 3, 2)
    b.inflight = 6
    assert room.free(100) == 1 + 0  # b is past its limit: no room, not negative
    a.inflight = 5
    assert room.full()
    a.inflight, a.batch.others = 3, 1  # another client's request there
    assert room.free(100) == 1
    a.waiting = 3  # a scrape's queue does not count once the limit is known
    assert room.free(100) == 1
    a.batch.probe = 2  # tried past the limit: a backlog's room only
    assert (room.free(100), room.free(100, probe=True)) == (1, 3)


def test_retry_after_follows_the_drain_rate() -> None:
    drain = DrainRate()
    assert drain.retry_after(100) == 1  # nothing drained yet: no estimate
    for _ in range(10):
        drain.left()
    assert 10 <= drain.retry_after(99) <= 20  # 100 at 5 to 10 a second


def test_the_reserve_keeps_as_many_slots_as_the_rate_of_its_requests_needs() -> None:
    """The kept slots taken are a birth-death chain (arrivals take one, the next
    completion gives it back): k slots are missed (arrivals / completions) ** k of the
    time; k is the least with that under 0.2%."""
    assert reserve_for(11, 44, 8) == 5  # 0.25 ** 5 = 0.1%, 0.25 ** 4 = 0.4%
    assert reserve_for(17, 43, 8) == 7  # 0.395 ** 7 = 0.15%, 0.395 ** 6 = 0.38%
    assert reserve_for(17, 43, 4) == 4  # at most the configured share of the slots
    assert reserve_for(50, 40, 4) == 4  # arrivals outrun completions: all it may
    assert reserve_for(0, 40, 4) == 1
    assert reserve_for(1, 1000, 4) == 1
