"""What GET /admin/pools and the kvroute_pool_* gauges advise: the backends wanted,
preferred pools first, and the rest removable."""

from __future__ import annotations

import pytest

import policies
from router.config import build
from router.fleet.backends import Fleet
from router.fleet.pools import pool_states


def fleet(routing: dict, inflight: dict[str, int], own: dict[str, dict] | None = None) -> Fleet:
    """Pools big, mid and small of 3 backends each; `own`: a pool's routing parameters."""
    own = own or {}
    pools = [
        {"name": name, "priority": i, "routing": own.get(name, {}), "backends": [
         {"url": f"http://127.0.0.1:{9000 + 10 * i + k}", "name": f"{name}{k}"} for k in range(3)]}
        for i, name in enumerate(("big", "mid", "small"))
    ]  # fmt: skip
    config = build({"pools": pools, "routing": routing})
    built = Fleet(config.backends, policies.create(config.routing))
    built.set_pools(config.pools)
    for b in built.members:
        b.local_inflight = inflight.get(b.name, 0)
    return built


@pytest.mark.parametrize(
    ("routing", "inflight", "wanted"),
    [
        pytest.param({}, {}, [1, 0, 0], id="idle: one preferred backend stays"),
        pytest.param({}, {"big0": 3, "big1": 1, "mid0": 2}, [3, 0, 0], id="busy count"),
        pytest.param(
            {"strategy": "PREFIX_AWARE", "concurrency_threshold": 4},
            {"big0": 4, "big1": 4, "big2": 4, "mid0": 4, "mid1": 1},
            [3, 2, 0],
            id="17 in flight, 4 each: 5 wanted, preferred first",
        ),
    ],
)
def test_wanted_fills_the_preferred_pools_first(routing, inflight, wanted) -> None:
    states = pool_states(fleet(routing, inflight))
    assert [s.name for s in states] == ["big", "mid", "small"]
    assert [s.wanted for s in states] == wanted
    assert [s.removable for s in states] == [3 - w for w in wanted]


def test_saturation_is_in_flight_over_the_usable_capacity() -> None:
    routing = {"strategy": "PREFIX_AWARE", "concurrency_threshold": 4}
    big, mid, _ = pool_states(fleet(routing, {"big0": 4, "big1": 2}))
    assert (big.inflight, big.saturation, mid.saturation) == (6, 0.5, 0.0)
    assert pool_states(fleet({}, {}))[0].saturation is None  # no threshold, no capacity


def test_a_pool_with_its_own_threshold_carries_by_it() -> None:
    """big takes 8 a backend, mid and small the fleet's 2: 28 in flight want big's 3
    (24), then 2 of mid (4)."""
    routing = {"strategy": "KV_AWARE", "concurrency_threshold": 2}
    own = {"big": {"concurrency_threshold": 8}}
    inflight = {"big0": 8, "big1": 8, "big2": 8, "mid0": 2, "mid1": 2}
    big, mid, small = pool_states(fleet(routing, inflight, own))
    assert [big.wanted, mid.wanted, small.wanted] == [3, 2, 0]
    assert (big.saturation, mid.saturation) == (1.0, 4 / 6)


def test_pools_without_thresholds_beside_one_with_want_what_the_busy_carry() -> None:
    """No fleet threshold, small's 1: 6 in flight over 3 busy backends carry 2 each, so
    big wants 3 for all 6 and small none."""
    own = {"small": {"concurrency_threshold": 1}}
    inflight = {"big0": 2, "big1": 2, "mid0": 2}
    states = pool_states(fleet({"strategy": "PREFIX_AWARE", "concurrency_threshold": None},
                               inflight, own))  # fmt: skip
    assert [s.wanted for s in states] == [3, 0, 0]
