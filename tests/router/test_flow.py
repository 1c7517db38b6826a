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
    all_saturated,
    rank_of,
    request_class,
)


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


class _Backend:
    def __init__(self, waiting: float, kv: float, inflight: int = 0, usable: bool = True):
        self.waiting, self.kv_usage, self.usable = waiting, kv, usable
        self.inflight, self.inflight_at_scrape = inflight, 0


def test_saturated_only_when_every_usable_backend_is() -> None:
    cfg = SaturationConfig(max_waiting=2, max_kv_cache_usage=0.9)
    full, kv_full = _Backend(3, 0.1), _Backend(0, 0.9)
    assert all_saturated([full, kv_full, _Backend(0, 0, usable=False)], cfg)
    assert not all_saturated([full, _Backend(0, 0.5)], cfg)
    assert all_saturated([full, _Backend(1, 0.5, inflight=2)], cfg)  # queueing, 2 added
    assert not all_saturated([full, _Backend(0, 0.5, inflight=30)], cfg)  # it batches them
    assert not all_saturated([], cfg)  # none usable: routing answers instead
    assert not all_saturated([full], SaturationConfig(enabled=False))


def test_retry_after_follows_the_drain_rate() -> None:
    drain = DrainRate()
    assert drain.retry_after(100) == 1  # nothing drained yet: no estimate
    for _ in range(10):
        drain.left()
    assert 10 <= drain.retry_after(99) <= 20  # 100 at 5 to 10 a second
