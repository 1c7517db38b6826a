"""What GET /admin/pools and the kvroute_pool_* gauges advise: the backends wanted,
preferred pools first, and the rest removable."""

from __future__ import annotations

import pytest

import policies
from router.config import build
from router.fleet.backends import Fleet
from router.fleet.pools import pool_states


def fleet(routing: dict, inflight: dict[str, int]) -> Fleet:
    pools = [
        {"name": name, "priority": i, "backends": [{"url": f"http://127.0.0.1:{9000 + 10 * i + k}",
         "name": f"{name}{k}"} for k in range(3)]}
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
