"""PREFIX_AWARE on plain objects: ring affinity, the bounded-load walk, both caps, config."""

from __future__ import annotations

import collections
import math

import pytest

import policies
from policies import Pick, Reason, RouteRequest
from policies.prefix_aware import PrefixAwareParams, PrefixAwarePolicy
from router.config import ConfigError, build
from tests.policies.plain import B, fleet

FP = 0x1234_5678_9ABC_DEF0
ONE = [{"url": "http://127.0.0.1:9001"}]


def make(members: list[B], **params) -> PrefixAwarePolicy:
    policy = policies.create(PrefixAwareParams(seed=1, **params))
    policy.on_fleet_change(tuple(members))
    return policy


def ring_order(policy: PrefixAwarePolicy, fp: int) -> list[str]:
    ring = policy._ring
    return [ring.members[i] for i in ring.walk(fp)]


def flood(policy: PrefixAwarePolicy, members: list[B], count: int, fp: int = FP) -> list[Pick]:
    """`count` requests of one fingerprint, none finishing: each adds load where it lands,
    as the router's accounting does."""
    view = fleet(members)
    picks = []
    for _ in range(count):
        pick = policy.pick(RouteRequest("m", fp), view)
        pick.backend.inflight += 1
        picks.append(pick)
    return picks


def relative_cap(load_factor: float, members: list[B], backend: B) -> int:
    """The documented cap once the request is placed: ceil(load_factor * T * w / W)."""
    total = sum(b.inflight for b in members)
    return math.ceil(load_factor * total * backend.weight / sum(b.weight for b in members))


@pytest.mark.parametrize(
    ("threshold", "load_factor", "loads", "down", "reason", "rank"),
    [
        pytest.param(4, 1.25, {}, (), Reason.AFFINITY, 0, id="owner-free"),
        pytest.param(4, None, {0: 4}, (), Reason.SPILL_THRESHOLD, 1, id="owner-at-threshold"),
        pytest.param(
            4, None, {0: 9, 1: 4}, (), Reason.SPILL_THRESHOLD, 2, id="two-full-takes-third"
        ),
        pytest.param(4, 1.25, {}, (0,), Reason.SPILL_UNAVAILABLE, 1, id="owner-down"),
        pytest.param(None, None, {0: 1000}, (), Reason.AFFINITY, 0, id="no-caps-never-spill"),
        # 6 candidates, T = 2: cap = ceil(1.25 * 3 / 6) = 1
        pytest.param(None, 1.25, {0: 2}, (), Reason.SPILL_THRESHOLD, 1, id="owner-over-mean"),
        # T = 12: cap = ceil(1.25 * 13 / 6) = 3
        pytest.param(
            None, 1.25, dict.fromkeys(range(6), 2), (), Reason.AFFINITY, 0, id="even-load-stays"
        ),
        # T = 13: cap = ceil(1.25 * 14 / 6) = 3, under the threshold of 32
        pytest.param(
            32,
            1.25,
            {0: 3, 1: 2, 2: 2, 3: 2, 4: 2, 5: 2},
            (),
            Reason.SPILL_THRESHOLD,
            1,
            id="relative-cap-binds-under-threshold",
        ),
        # relative cap ceil(100 * 5 / 6) = 84: the threshold binds first
        pytest.param(
            4, 100.0, {0: 4}, (), Reason.SPILL_THRESHOLD, 1, id="threshold-binds-under-loose-factor"
        ),
        # 5 candidates, T = 5: cap = ceil(1.25 * 6 / 5) = 2
        pytest.param(4, 1.25, {1: 5}, (0,), Reason.SPILL_THRESHOLD, 2, id="down-then-full"),
        pytest.param(4, None, {0: 4}, (1,), Reason.SPILL_THRESHOLD, 2, id="full-then-down"),
        # only candidates count: T = 1 over 5, cap = ceil(1.25 * 2 / 5) = 1
        pytest.param(
            None, 1.25, {0: 1, 1: 100}, (1,), Reason.SPILL_THRESHOLD, 2, id="down-load-not-counted"
        ),
    ],
)
def test_bounded_walk(threshold, load_factor, loads, down, reason, rank) -> None:
    members = [B(n) for n in "abcdef"]
    policy = make(members, concurrency_threshold=threshold, load_factor=load_factor)
    order = ring_order(policy, FP)
    by_name = {b.name: b for b in members}
    for r, load in loads.items():
        by_name[order[r]].inflight = load
    pick = policy.pick(RouteRequest("m", FP), fleet(members, down=tuple(order[r] for r in down)))
    assert (pick.backend.name, pick.reason) == (order[rank], reason)


@pytest.mark.parametrize(
    ("weights", "load_factor", "requests", "run"),
    [
        pytest.param([1] * 4, 1.25, 480, 4, id="four-default"),
        pytest.param([1] * 8, 1.05, 400, 8, id="eight-tight"),
        pytest.param([1] * 3, 2.0, 60, 2, id="three-loose"),
        pytest.param([1, 2, 1, 4], 1.25, 400, 3, id="weighted"),
        pytest.param([1] * 64, 1.25, 2000, 52, id="sixty-four"),
    ],
)
def test_hot_fingerprint_spreads_within_the_cap(weights, load_factor, requests, run) -> None:
    """Rising load on one fingerprint fills the owner's ring run backend by backend, each to
    its cap, so about n / load_factor backends share it (`run`) and none goes over."""
    members = [B(f"b{i}", weight=w) for i, w in enumerate(weights)]
    policy = make(members, concurrency_threshold=None, load_factor=load_factor)
    view = fleet(members)
    for _ in range(requests):
        pick = policy.pick(RouteRequest("m", FP), view)
        assert pick.reason in {Reason.AFFINITY, Reason.SPILL_THRESHOLD}
        pick.backend.inflight += 1
        assert pick.backend.inflight <= relative_cap(load_factor, members, pick.backend)
    mean = requests / sum(weights)
    assert all(b.inflight < load_factor * mean * b.weight + 1 for b in members)
    by_name = {b.name: b for b in members}
    used = [by_name[name].inflight > 0 for name in ring_order(policy, FP)]
    assert used == [True] * run + [False] * (len(members) - run)


@pytest.mark.parametrize(
    ("weights", "load_factor"),
    [
        pytest.param([1], 1.25, id="one-backend"),
        pytest.param([1, 1], 1.0001, id="two-barely-above-one"),
        pytest.param([1] * 64, 1.0001, id="sixty-four-barely-above-one"),
        pytest.param([1] + [20] * 15, 1.0001, id="light-owner-among-heavy"),
        pytest.param([3, 1, 2, 1], 8.0, id="weighted-loose"),
    ],
)
def test_a_lone_request_goes_to_its_owner(weights, load_factor) -> None:
    members = [B(f"b{i}", weight=w) for i, w in enumerate(weights)]
    policy = make(members, load_factor=load_factor)
    view = fleet(members)
    for fp in range(0, 2**64, 2**58 + 12345):
        pick = policy.pick(RouteRequest("m", fp), view)
        assert (pick.backend.name, pick.reason) == (ring_order(policy, fp)[0], Reason.AFFINITY)


@pytest.mark.parametrize(
    ("size", "fp"),
    [
        pytest.param(4, FP, id="four"),
        pytest.param(7, 2**64 - 1, id="seven-wrapping"),
        pytest.param(16, 0, id="sixteen-key-zero"),
    ],
)
def test_the_walk_is_the_owners_ring_order_in_every_worker(size, fp) -> None:
    """Two policies built apart (members listed in opposite orders) stand for two workers
    or replicas: seeing the same loads, they spill in the same order, the ring's."""
    names = [f"10.0.0.{i}:8000" for i in range(size)]
    first = [B(n) for n in names]
    second = [B(n) for n in reversed(names)]
    one, other = make(first), make(second)
    picked = [p.backend.name for p in flood(one, first, 4 * size, fp)]
    assert picked == [p.backend.name for p in flood(other, second, 4 * size, fp)]
    order = ring_order(one, fp)
    assert order == ring_order(other, fp)
    run = list(dict.fromkeys(picked))
    assert len(run) > 1 and run == order[: len(run)]


@pytest.mark.parametrize(
    ("load_factor", "threshold", "size"),
    [
        pytest.param(1.25, 3, 4, id="default-factor"),
        pytest.param(None, 3, 4, id="no-relative-cap"),
        pytest.param(1000.0, 5, 6, id="loose-factor"),
    ],
)
def test_concurrency_threshold_caps_absolutely(load_factor, threshold, size) -> None:
    members = [B(f"b{i}") for i in range(size)]
    policy = make(members, concurrency_threshold=threshold, load_factor=load_factor)
    picks = flood(policy, members, threshold * size)
    assert [b.inflight for b in members] == [threshold] * size
    assert Reason.ALL_SATURATED not in {p.reason for p in picks}
    assert flood(policy, members, 1)[0].reason is Reason.ALL_SATURATED


def test_null_load_factor_fills_each_backend_to_the_threshold_in_ring_order() -> None:
    """The behaviour before bounded load: the owner takes `concurrency_threshold`, then
    the next on the ring does, and so on."""
    members = [B(n) for n in "abcdef"]
    policy = make(members, concurrency_threshold=4, load_factor=None)
    picked = [p.backend.name for p in flood(policy, members, 24)]
    assert picked == [name for name in ring_order(policy, FP) for _ in range(4)]


def test_all_saturated_takes_least_loaded() -> None:
    members = [B("a", 5), B("b", 3), B("c", 7)]
    policy = make(members, concurrency_threshold=2)
    pick = policy.pick(RouteRequest("m", 42), fleet(members))
    assert (pick.backend, pick.reason) == (members[1], Reason.ALL_SATURATED)


def test_same_fingerprint_same_backend_and_spread() -> None:
    members = [B(n) for n in "abcd"]
    policy = make(members)
    view = fleet(members)
    assert len({policy.pick(RouteRequest("m", 77), view).backend.name for _ in range(50)}) == 1
    counts = collections.Counter(
        policy.pick(RouteRequest("m", fp * 0x9E3779B97F4A7C15 % 2**64), view).backend.name
        for fp in range(4000)
    )
    assert max(counts.values()) / (4000 / 4) < 1.3, counts


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(..., 1.25, id="default"),
        pytest.param(None, None, id="null-disables"),
        pytest.param(1.01, 1.01, id="just-above-one"),
        pytest.param(2, 2.0, id="an-int"),
    ],
)
def test_load_factor_config(value, expected) -> None:
    routing = {"strategy": "PREFIX_AWARE"} | ({} if value is ... else {"load_factor": value})
    assert build({"backends": ONE, "routing": routing}).routing.load_factor == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param(0.5, "Expected `float` > 1.0", id="below-one"),
        pytest.param(1.0, "Expected `float` > 1.0", id="exactly-one"),
        pytest.param(-2, "Expected `float` > 1.0", id="negative"),
        pytest.param(float("nan"), "Expected `float` > 1.0", id="nan"),
        pytest.param("1.5", "got `str`", id="a-string"),
    ],
)
def test_load_factor_config_bounds(value, message) -> None:
    routing = {"strategy": "PREFIX_AWARE", "load_factor": value}
    with pytest.raises(ConfigError, match=message) as err:
        build({"backends": ONE, "routing": routing})
    assert "$.routing.load_factor" in str(err.value)
