"""PREFIX_AWARE on plain objects: ring affinity, the bounded-load walk, both caps, config."""

from __future__ import annotations

import collections
import contextlib
import math
import random
from collections.abc import Iterator

import pytest

import policies
from policies import Pick, Reason, RouteRequest
from policies.prefix_aware import PrefixAwareParams, PrefixAwarePolicy
from router.config import ConfigError, build
from router.fleet.placements import PlacementTable
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
    """The caps alone (a floor of 1: the relative cap binds from the first request)."""
    members = [B(n) for n in "abcdef"]
    policy = make(members, concurrency_threshold=threshold, load_factor=load_factor, load_floor=1)
    order = ring_order(policy, FP)
    by_name = {b.name: b for b in members}
    for r, load in loads.items():
        by_name[order[r]].inflight = load
    pick = policy.pick(RouteRequest("m", FP), fleet(members, down=tuple(order[r] for r in down)))
    assert (pick.backend.name, pick.reason) == (order[rank], reason)


@pytest.mark.parametrize(
    ("weights", "load_factor", "requests"),
    [
        pytest.param([1] * 4, 1.25, 480, id="four-default"),
        pytest.param([1] * 8, 1.05, 400, id="eight-tight"),
        pytest.param([1] * 3, 2.0, 60, id="three-loose"),
        pytest.param([1, 2, 1, 4], 1.25, 400, id="weighted"),
        pytest.param([1] * 64, 1.25, 2000, id="sixty-four"),
    ],
)
def test_hot_fingerprint_spreads_within_the_cap(weights, load_factor, requests) -> None:
    """Rising load on one fingerprint (none finishing) stays on a backend up to its cap,
    then moves to the first backend under the mean along the fingerprint's ring order:
    none goes over the cap."""
    members = [B(f"b{i}", weight=w) for i, w in enumerate(weights)]
    policy = make(members, concurrency_threshold=None, load_factor=load_factor, load_floor=1)
    view = fleet(members)
    for _ in range(requests):
        pick = policy.pick(RouteRequest("m", FP), view)
        assert pick.reason in {Reason.AFFINITY, Reason.SPILL_THRESHOLD}
        pick.backend.inflight += 1
        assert pick.backend.inflight <= relative_cap(load_factor, members, pick.backend)
    mean = requests / sum(weights)
    assert all(b.inflight < load_factor * mean * b.weight + 1 for b in members)


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
        pytest.param(..., 1.5, id="default"),
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


def steady(
    workers: list[PrefixAwarePolicy], members: list[B], fingerprints: list[int], window: int
) -> tuple[list[str], collections.Counter[str], set[tuple[int, str]]]:
    """Requests of `fingerprints` in turn, through each of `workers` in turn, each
    finishing `window` arrivals after it came (so about `window` are in flight): where
    each went, how many each backend took, and the (prefix, backend) pairs met (each a
    cache miss)."""
    view = fleet(members)
    running: collections.deque[B] = collections.deque()
    picked: list[str] = []
    met: set[tuple[int, str]] = set()
    for i, fp in enumerate(fingerprints):
        if len(running) >= window:
            running.popleft().inflight -= 1
        backend = workers[i % len(workers)].pick(RouteRequest("m", fp), view).backend
        backend.inflight += 1
        running.append(backend)
        picked.append(backend.name)
        met.add((fp, backend.name))
    return picked, collections.Counter(picked), met


def test_a_prefix_stays_where_it_went_last_while_under_the_bound() -> None:
    """Its owner full, a prefix moves to the next backend on its ring and stays there
    once the owner is free again, until that backend is full in turn: then it moves on
    along the ring, to the next backend under the mean."""
    members = [B(f"10.0.0.{i}:8000") for i in range(4)]
    policy = make(members)
    view = fleet(members)
    owner, second, third, fourth = (
        next(b for b in members if b.name == n) for n in ring_order(policy, FP)
    )
    owner.inflight = 8  # over the floor and 1.5 x the mean
    assert policy.pick(RouteRequest("m", FP), view) == Pick(second, Reason.SPILL_THRESHOLD)
    owner.inflight, second.inflight = 0, 3
    for _ in range(3):
        assert policy.pick(RouteRequest("m", FP), view) == Pick(second, Reason.AFFINITY, warm=True)
    second.inflight, third.inflight = 8, 3  # the mean counting this request: 11 / 4
    assert policy.pick(RouteRequest("m", FP), view) == Pick(fourth, Reason.SPILL_THRESHOLD)
    assert policy.pick(RouteRequest("m", FP), view) == Pick(fourth, Reason.AFFINITY, warm=True)


@pytest.mark.parametrize(
    ("floor", "stays_up_to"),
    [
        pytest.param(4, 3, id="default-floor"),
        pytest.param(16, 15, id="a-batch-of-sixteen"),
        pytest.param(1, 0, id="no-floor"),
    ],
)
def test_the_relative_cap_binds_only_past_the_floor(floor, stays_up_to) -> None:
    """A light fleet is no reason to move a prefix: under `load_floor` in flight its
    backend keeps it, however far above the mean; at the floor the cap binds."""
    members = [B(f"10.0.0.{i}:8000") for i in range(4)]
    policy = make(members, load_floor=floor) if floor != 4 else make(members)
    owner = next(b for b in members if b.name == ring_order(policy, FP)[0])
    for load in range(stays_up_to + 2):
        owner.inflight = load
        pick = policy.pick(RouteRequest("m", FP), fleet(members))
        assert (pick.backend is owner) == (load <= stays_up_to), load


@pytest.mark.parametrize(
    ("size", "window"),
    [
        pytest.param(4, 12, id="four-light"),
        pytest.param(4, 16, id="four"),
        pytest.param(4, 32, id="four-busy"),
        pytest.param(8, 40, id="eight"),
    ],
)
def test_one_prefix_that_is_the_whole_load_reaches_every_backend(size, window) -> None:
    """Every request shares one fingerprint (a system prompt longer than prefix_length):
    the prefix moves on to a backend under the mean each time its backend fills, so each
    backend takes between half and 1.3 times the mean, none only what the others leave."""
    members = [B(f"10.0.0.{i}:8000") for i in range(size)]
    _, taken, _ = steady([make(members)], members, [FP] * 60 * size, window)
    assert all(30 <= taken[b.name] <= 78 for b in members), taken


def test_many_prefixes_balance_and_keep_their_backends() -> None:
    """24 documents hashed unevenly over 4 backends, 360 requests with about 16 in
    flight: the busiest takes at most 1.3 times the mean, and a document meets few
    backends (each a cache miss)."""
    members = [B(f"10.0.0.{i}:8000") for i in range(4)]
    docs = [(i + 1) * 0x9E3779B97F4A7C15 % 2**64 for i in range(24)]
    rng = random.Random(7)
    _, taken, met = steady([make(members)], members, [rng.choice(docs) for _ in range(360)], 16)
    assert max(taken.values()) <= 1.3 * 90, taken
    assert len(met) <= 52, len(met)  # about two backends each (bounded load alone: 57)


@contextlib.contextmanager
def workers_sharing(tmp_path, members: list[B], count: int) -> Iterator[list[PrefixAwarePolicy]]:
    """`count` policies standing for one router's workers: each its own mapping of one
    placements table (router/fleet/placements.py), as `serve --workers` gives them."""
    tables = [
        PlacementTable(tmp_path / "placements", w, lambda _: None, False) for w in range(count)
    ]
    workers = [make(members) for _ in tables]
    for policy, table in zip(workers, tables, strict=True):
        table.known(b.name for b in members)
        policy.share(table)
    try:
        yield workers
    finally:
        for table in tables:
            table.close()


async def test_a_prefix_moved_by_one_worker_stays_put_through_another(tmp_path) -> None:
    """Worker 0 moves a prefix off its full owner; worker 1, asked next with the owner
    free again, sends it where worker 0 did, not to the owner."""
    members = [B(f"10.0.0.{i}:8000") for i in range(4)]
    with workers_sharing(tmp_path, members, 2) as (first, second):
        owner, after, *_ = (next(b for b in members if b.name == n) for n in ring_order(first, FP))
        owner.inflight = 8
        assert first.pick(RouteRequest("m", FP), fleet(members)).backend is after
        owner.inflight = 0
        assert second.pick(RouteRequest("m", FP), fleet(members)) == Pick(
            after, Reason.AFFINITY, warm=True
        )


@pytest.mark.parametrize(
    "fingerprints",
    [
        pytest.param([FP] * 240, id="one-prefix"),
        pytest.param([(i % 24 + 1) * 0x9E3779B97F4A7C15 % 2**64 for i in range(360)], id="24-docs"),
    ],
)
async def test_the_walk_is_the_same_in_every_worker(tmp_path, fingerprints) -> None:
    """Requests dealt in turn to three workers sharing placements go exactly where one
    worker alone sends them: every move one makes, the others follow."""
    members, again = ([B(f"10.0.0.{i}:8000") for i in range(4)] for _ in range(2))
    alone, *_ = steady([make(members)], members, fingerprints, 16)
    with workers_sharing(tmp_path, again, 3) as workers:
        dealt, *_ = steady(workers, again, fingerprints, 16)
    assert dealt == alone
    assert len(set(alone)) == 4
