"""KV_AWARE on plain objects: cost ordering, cache affinity, hot-prefix spread, caps."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from hashing.blocks import chain, root_key
from policies import FleetView, Reason, RouteRequest, create
from policies.kv_aware import KvAwareParams

ROOT = root_key("m", None)
IDS = list(range(8000))
BLOCKS = chain(ROOT, IDS, 16)


@dataclass
class B:
    name: str
    inflight: int = 0
    weight: int = 1
    queued_tokens: int = 0
    waiting: float = 0.0


def view(members: list[B]) -> FleetView:
    return FleetView(tuple(members), tuple(members), frozenset(b.name for b in members))


def policy(**params):
    p = create(KvAwareParams(seed=1, **params))
    return p


def hold(p, backend: str, blocks: int) -> None:
    p.index.stored(backend, None, list(range(blocks)), IDS[: blocks * 16], 16, ROOT)


def request() -> RouteRequest:
    return RouteRequest("m", 0, BLOCKS, len(IDS))


def test_prefers_the_backend_holding_the_prefix() -> None:
    p = policy()
    members = [B("a"), B("b"), B("c")]
    hold(p, "b", 400)
    pick = p.pick(request(), view(members))
    assert (pick.backend.name, pick.reason, pick.predicted_cached) == ("b", Reason.KV_HIT, 6400)
    assert p.recent[-1]["scores"]["b"]["cached"] == 6400


def test_longer_prefix_wins_over_shorter() -> None:
    p = policy()
    hold(p, "a", 100)
    hold(p, "b", 300)
    assert p.pick(request(), view([B("a"), B("b")])).backend.name == "b"


def test_queue_outweighs_cache_when_large() -> None:
    p = policy()
    hold(p, "a", 500)
    busy = B("a", inflight=8, queued_tokens=80_000)  # 8 s of prefill queued
    pick = p.pick(request(), view([busy, B("b")]))
    assert (pick.backend.name, pick.reason) == ("b", Reason.KV_COLD)


def test_cold_requests_spread_and_then_stick() -> None:
    p = policy()
    members = [B(n) for n in "abcd"]
    counts = collections.Counter()
    for i in range(200):
        ids = [i * 10_000 + t for t in range(160)]
        req = RouteRequest("m", 0, chain(ROOT, ids, 16), len(ids))
        counts[p.pick(req, view(members)).backend.name] += 1
    assert len(counts) == 4 and min(counts.values()) > 25, counts
    # the speculative insert keeps a burst of one new prefix together
    first = p.pick(request(), view(members)).backend.name
    assert {p.pick(request(), view(members)).backend.name for _ in range(10)} == {first}


def test_hot_prefix_spreads_over_a_small_set() -> None:
    p = policy()
    members = [B(n) for n in "abcdefg"]
    chosen = []
    for _ in range(120):  # concurrent: nothing finishes, each adds load where it lands
        pick = p.pick(request(), view(members))
        pick.backend.inflight += 1  # the router's accounting, as dispatch does it
        pick.backend.queued_tokens += len(IDS) - pick.predicted_cached
        chosen.append(pick.backend.name)
    used = collections.Counter(chosen)
    assert 2 <= len(used) <= 4, used  # spread, but not scattered over every backend


def test_concurrency_threshold_is_a_hard_cap() -> None:
    p = policy(concurrency_threshold=2)
    hold(p, "a", 500)
    pick = p.pick(request(), view([B("a", inflight=2), B("b", inflight=1)]))
    assert pick.backend.name == "b"
    pick = p.pick(request(), view([B("a", inflight=2), B("b", inflight=3)]))
    assert (pick.backend.name, pick.reason) == ("a", Reason.ALL_SATURATED)


def test_no_candidate() -> None:
    pick = policy().pick(request(), FleetView((), (), frozenset()))
    assert (pick.backend, pick.reason) == (None, Reason.NO_CANDIDATE)


def test_a_cold_prompt_keeps_off_busy_backends() -> None:
    """A cold prefill stalls every request running where it lands (one long engine step):
    among equal costs it goes where the fewest requests run, and never to a hot prefix's
    holder; a warm request still goes to the holder."""
    p = policy()
    holder, light, lighter = B("a", inflight=9), B("b", inflight=2), B("c", inflight=1)
    hold(p, "a", 500)
    for i in range(1, 21):  # 20 new prompts (i = 0 would be the held one)
        ids = [i * 10_000 + t for t in range(8000)]
        req = RouteRequest("m", 0, chain(ROOT, ids, 16), len(ids))
        assert p.pick(req, view([holder, light, lighter])).backend.name == "c"
    assert p.pick(request(), view([holder, light, lighter])).backend.name == "a"
