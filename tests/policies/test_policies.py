"""Every strategy on plain objects: table-driven, one named row per case."""

from __future__ import annotations

import collections

import pytest

import policies
from policies import Reason, RouteRequest
from policies.least_outstanding_requests import LeastOutstandingRequestsParams
from policies.prefix_aware import PrefixAwareParams
from policies.random import RandomParams
from policies.round_robin import RoundRobinParams
from tests.policies.plain import B, fleet


def make(params, members: list[B]):
    policy = policies.create(params)
    policy.on_fleet_change(tuple(members))
    return policy


def test_registry_lists_every_strategy() -> None:
    assert policies.names() == [
        "KV_AWARE",
        "LEAST_OUTSTANDING_REQUESTS",
        "PREFIX_AWARE",
        "RANDOM",
        "ROUND_ROBIN",
    ]


@pytest.mark.parametrize(
    "params",
    [
        pytest.param(RandomParams(seed=1), id="random"),
        pytest.param(RoundRobinParams(), id="round-robin"),
        pytest.param(LeastOutstandingRequestsParams(seed=1), id="lor"),
        pytest.param(PrefixAwareParams(seed=1), id="prefix-aware"),
    ],
)
def test_no_candidate(params) -> None:
    members = [B("a"), B("b")]
    pick = make(params, members).pick(RouteRequest("m", 1), fleet(members, down=("a", "b")))
    assert (pick.backend, pick.reason) == (None, Reason.NO_CANDIDATE)


def test_random_is_roughly_uniform() -> None:
    members = [B(n) for n in "abcd"]
    policy = make(RandomParams(seed=3), members)
    view = fleet(members)
    counts = collections.Counter(
        policy.pick(RouteRequest("m"), view).backend.name for _ in range(4000)
    )
    assert all(850 < c < 1150 for c in counts.values()), counts


def test_round_robin_cycles() -> None:
    members = [B(n) for n in "abc"]
    policy = make(RoundRobinParams(), members)
    view = fleet(members)
    assert [policy.pick(RouteRequest("m"), view).backend.name for _ in range(6)] == list("abcabc")


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        pytest.param({"a": 3, "b": 0, "c": 5}, {"b"}, id="single-idle"),
        pytest.param({"a": 2, "b": 1, "c": 1}, {"b", "c"}, id="tie-split"),
        pytest.param({"a": 0, "b": 0, "c": 0}, {"a", "b", "c"}, id="all-idle"),
    ],
)
def test_least_outstanding(loads: dict[str, int], expected: set[str]) -> None:
    members = [B(n, loads[n]) for n in "abc"]
    policy = make(LeastOutstandingRequestsParams(seed=5), members)
    picks = {policy.pick(RouteRequest("m"), fleet(members)).backend.name for _ in range(200)}
    assert picks == expected  # ties are broken at random, so every tied backend shows up
