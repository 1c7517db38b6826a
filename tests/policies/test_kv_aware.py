"""KV_AWARE on plain objects: cost ordering, cache affinity, hot-prefix spread, caps."""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass

import msgspec
import pytest

from hashing.blocks import chain, root_key
from policies import FleetView, Reason, RouteRequest, Speed, create, tuned_params
from policies.kv_aware import KvAwareParams, KvTierParams
from policies.kv_aware.scoring import WHOLE

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
    speed: Speed | None = None


def view(members: list[B]) -> FleetView:
    return FleetView(tuple(members), tuple(members), frozenset(b.name for b in members))


def policy(**params):
    p = create(KvAwareParams(seed=1, **params))
    return p


def hold(p, backend: str, blocks: int) -> None:
    p.index.gpu.stored(backend, None, list(range(blocks)), IDS[: blocks * 16], 16, ROOT)


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
    """One document, each request with its own 400-token question, all at once: it
    spreads as its holders' queues and batches grow, each new holder prefilling it once."""
    p = policy()
    members = [B(n) for n in "abcdefg"]
    chosen, cold = [], 0
    for i in range(20):  # concurrent: nothing finishes, each adds load where it lands
        ids = IDS + [100_000 + 1000 * i + t for t in range(400)]
        req = RouteRequest("m", 0, chain(ROOT, ids, 16), len(ids))
        pick = p.pick(req, view(members))
        pick.backend.inflight += 1  # the router's accounting, as dispatch does it
        pick.backend.queued_tokens += len(ids) - pick.predicted_cached
        chosen.append(pick.backend.name)
        cold += pick.reason is Reason.KV_COLD
    used = collections.Counter(chosen)
    assert 2 <= len(used) < len(members), used  # spread, but not over every backend
    assert cold == len(used)


def test_concurrency_threshold_is_a_hard_cap() -> None:
    p = policy(concurrency_threshold=2)
    hold(p, "a", 500)
    pick = p.pick(request(), view([B("a", inflight=2), B("b", inflight=1)]))
    assert pick.backend.name == "b"
    pick = p.pick(request(), view([B("a", inflight=2), B("b", inflight=3)]))
    assert (pick.backend.name, pick.reason) == ("a", Reason.ALL_SATURATED)


def test_max_queue_s_caps_the_estimated_queue() -> None:
    """10,000 queued tokens at 10,000 a second is a 1 s queue: over a 0.5 s cap, even
    holding the prefix; with every backend over it, saturated (a pool passes it on)."""
    p = policy(max_queue_s=0.5)
    hold(p, "a", 500)
    pick = p.pick(request(), view([B("a", queued_tokens=10_000), B("b", waiting=2)]))
    assert pick.backend.name == "b"  # 2 waiting x 0.05 s: under the cap
    pick = p.pick(request(), view([B("a", queued_tokens=10_000), B("b", waiting=20)]))
    assert pick.reason is Reason.ALL_SATURATED


def test_a_pools_tuned_twin_shares_what_the_policy_learns_and_caps_by_its_own() -> None:
    """The twin sees the fleet policy's index (and the reverse), its decisions show
    beside the policy's, and only its own cap binds it."""
    p = policy(concurrency_threshold=1)
    twin = p.tuned(tuned_params(p.params, {"concurrency_threshold": 4}))
    hold(p, "a", 500)
    a = B("a", inflight=2)
    assert p.pick(request(), view([a, B("b")])).backend.name == "b"  # a: over the fleet's cap
    pick = twin.pick(request(), view([a, B("b", inflight=4)]))  # b: at the twin's
    assert (pick.backend.name, pick.reason) == ("a", Reason.KV_HIT)
    assert [d["chosen"] for d in p.recent[-2:]] == ["b", "a"]
    p.event_backends.add("a")
    assert twin.event_backends == {"a"}
    assert p.params.concurrency_threshold == 1  # the policy keeps its own


def test_no_candidate() -> None:
    pick = policy().pick(request(), FleetView((), (), frozenset()))
    assert (pick.backend, pick.reason) == (None, Reason.NO_CANDIDATE)


def _new_prompt(i: int, tokens: int = 8000) -> RouteRequest:
    ids = [i * 10_000 + t for t in range(tokens)]
    return RouteRequest("m", 0, chain(ROOT, ids, 16), len(ids))


def test_a_cold_prompt_keeps_off_busy_backends() -> None:
    """A cold prompt goes where it costs least: never behind a hot prefix's holder with a
    queue and a batch, and spread over the others as they fill; a warm request still
    goes to the holder."""
    p = policy()
    holder = B("a", inflight=9, queued_tokens=4000)
    light, lighter = B("b", inflight=2), B("c", inflight=1)
    hold(p, "a", 500)
    members = view([holder, light, lighter])
    used = collections.Counter()
    for i in range(1, 11):  # 10 new prompts (i = 0 would be the held one), each staying
        chosen = p.pick(_new_prompt(i), members).backend
        chosen.inflight += 1
        used[chosen.name] += 1
    assert set(used) == {"b", "c"}, used
    assert p.pick(request(), members).backend.name == "a"


def test_a_cold_prompt_ties_only_on_queueing_it_would_not_wait_for() -> None:
    """Between cold candidates every gap is queueing: a backend with 50 ms of prefill
    queued loses to an idle one, although 50 ms is within `tie_fraction` of the prefill."""
    p = policy()
    members = view([B("a", queued_tokens=500), B("b"), B("c", queued_tokens=500)])
    assert {p.pick(_new_prompt(i), members).backend.name for i in range(1, 21)} == {"b"}


def test_a_hit_moves_only_when_it_saves_more_than_the_prefill_it_adds() -> None:
    """The holder has 0.9 s of prefill queued: elsewhere the 8,000-token prompt would
    start at once (0.8 s), but it would add 0.8 s of prefill to the fleet; it stays until
    the holder's queue exceeds that too (miss_penalty 1), or moves at miss_penalty 0."""
    hold_queue = B("a", queued_tokens=9000)
    for penalty, queued, expected in ((1.0, 9000, "a"), (1.0, 20000, "b"), (0.0, 9000, "b")):
        p = policy(miss_penalty=penalty)
        hold(p, "a", 500)
        hold_queue.queued_tokens = queued
        assert p.pick(request(), view([hold_queue, B("b")])).backend.name == expected, penalty


def test_every_process_places_new_prefixes_alike() -> None:
    """No shared state: two policies (other seeds, their own indexes) that see the same
    near-tied fleet send each new prefix to the same backend, and spread them."""
    first, second = create(KvAwareParams(seed=1)), create(KvAwareParams(seed=2))
    members = [B(n, inflight=1) for n in "abcd"]
    picks = [
        [p.pick(_new_prompt(i, 400), view(members)).backend.name for i in range(40)]
        for p in (first, second)
    ]
    assert picks[0] == picks[1]
    assert len(set(picks[0])) == 4


class SharedDict:
    """Placements in one process: what router/fleet/placements.py shares between workers."""

    def __init__(self) -> None:
        self.placed: dict[int, tuple[str, list[int], float]] = {}
        self.replicated: list[tuple[str, list[int]]] = []

    def place(self, backend: str, keys, start: int, expires_at: float) -> None:
        self.placed[keys[start]] = (backend, list(keys[start:]), expires_at)

    def held(self, keys, start: int):
        found = self.placed.get(keys[start])
        if found is None:
            return None
        backend, placed, expires_at = found
        count = next(
            (n for n in range(len(placed), 0, -1) if list(keys[start : start + n]) == placed[:n]), 0
        )
        return backend, count, expires_at

    def replicate(self, backend: str, keys, start: int, expires_at: float) -> None:
        self.replicated.append((backend, list(keys[start:])))

    def withdraw(self, backend: str, keys, start: int) -> None:
        self.placed.pop(keys[start], None)

    def recall(self, backend: str, keys, start: int) -> None:
        self.replicated.remove((backend, list(keys[start:])))


def test_a_burst_over_two_workers_stays_on_one_backend() -> None:
    """Two workers' policies, each with its own index, share placements and the load
    table (the same B objects): a burst of one new prefix alternating between them lands
    on one backend, although each worker's first request finds it cold in its index."""
    shared, members = SharedDict(), [B(n) for n in "abcd"]
    workers = [create(KvAwareParams(seed=s)) for s in (1, 2)]
    for w in workers:
        w.share(shared)
    chosen = set()
    for i in range(12):  # concurrent: nothing finishes
        pick = workers[i % 2].pick(request(), view(members))
        pick.backend.inflight += 1
        pick.backend.queued_tokens += len(IDS) - pick.predicted_cached
        chosen.add(pick.backend.name)
    assert len(chosen) == 1, chosen


def test_over_a_shared_index_a_burst_stays_together_without_the_placements(tmp_path) -> None:
    """Two workers' policies over one shared index: each sees the other's placement in
    it, so a burst of one new prefix stays on one backend while the placements table is
    neither written nor read; the placements go only to `replicate` (other replicas)."""
    shared, members = SharedDict(), [B(n) for n in "abcd"]
    workers = [create(KvAwareParams(seed=s)) for s in (1, 2)]
    for w in workers:
        w.share_index(str(tmp_path))
        w.on_fleet_change(tuple(members))
        w.share(shared)
    chosen = set()
    for i in range(12):
        pick = workers[i % 2].pick(request(), view(members))
        pick.backend.inflight += 1
        pick.backend.queued_tokens += len(IDS) - pick.predicted_cached
        chosen.add(pick.backend.name)
    assert len(chosen) == 1, chosen
    assert shared.placed == {}
    assert [name for name, _ in shared.replicated] == [chosen.pop()]
    other = RouteRequest("m", 0, chain(ROOT, [i + 7 for i in IDS], 16), len(IDS))  # not followed
    pick = workers[0].pick(other, view(members))
    assert len(shared.replicated) == 2
    workers[0].retract(other, pick)
    assert len(shared.replicated) == 1 and shared.placed == {}
    assert workers[1].pick(other, view(members)).predicted_cached == 0


# --- pruned scoring: the holders of the longest prefixes and `sample` draws -----------


def _fleet(size: int, seed: int) -> list[B]:
    rng = random.Random(seed)
    return [
        B(f"b{i}", inflight=rng.randrange(8), queued_tokens=rng.randrange(0, 12_000, 100))
        for i in range(size)
    ]


def _both(members: list[B], held: dict[str, int]) -> tuple:
    """A pruned (default) and an exhaustive (sample 0) policy with the same index."""
    pair = policy(), policy(sample=0)
    for p in pair:
        for name, blocks in held.items():
            hold(p, name, blocks)
    return pair


def test_pruned_pick_is_the_full_pick_when_it_goes_to_a_holder() -> None:
    """Over random loads and holder sets in a fleet of 64, whenever scoring every
    candidate sends the request to a backend holding a prefix, pruned scoring sends it to
    the same one, with the same cached prediction."""
    checked = 0
    for trial in range(200):
        rng = random.Random(trial)
        members = _fleet(64, trial)
        held = {f"b{rng.randrange(64)}": rng.randrange(1, 500) for _ in range(rng.randrange(1, 6))}
        pruned, full = _both(members, held)
        expected = full.pick(request(), view(members))
        if expected.reason is not Reason.KV_HIT:
            continue
        checked += 1
        assert pruned.pick(request(), view(members)) == expected, (trial, held)
    assert checked > 100  # the table above is mostly hits


def test_pruned_scores_the_holders_and_sample_others() -> None:
    p = policy()
    members = _fleet(256, 0)
    for name in ("b3", "b200"):
        hold(p, name, 300)
    p.pick(request(), view(members))
    scores = p.recent[-1]["scores"]
    assert {"b3", "b200"} <= set(scores) and len(scores) == 2 + 3, scores


def test_a_cold_prompt_goes_to_the_least_loaded_of_its_draws() -> None:
    """New prompts over 200 backends whose load runs 0..9 in-flight: each goes to the
    least loaded of three draws, so they spread over the fleet and keep off its busy half
    (the mean load of a pick is about 2, against 4.5 for the fleet)."""
    p = policy()
    members = [B(f"b{i}", inflight=i % 10) for i in range(200)]
    chosen = [p.pick(_new_prompt(i, 800), view(members)).backend for i in range(1, 301)]
    assert len({b.name for b in chosen}) > 80
    assert sum(b.inflight for b in chosen) / len(chosen) < 3


def test_draws_are_agreed_for_a_prompt_and_differ_between_prompts() -> None:
    """Two policies (other seeds, own indexes) draw the same backends for one prompt, so
    replicas still place a new prefix alike in an idle fleet of 64."""
    members = [B(f"b{i}") for i in range(64)]
    first, second = create(KvAwareParams(seed=1)), create(KvAwareParams(seed=2))
    picks = [
        [p.pick(_new_prompt(i), view(members)).backend.name for i in range(40)]
        for p in (first, second)
    ]
    assert picks[0] == picks[1]
    assert len(set(picks[0])) > 20


def test_pruned_never_scores_a_backend_outside_the_view() -> None:
    """Backends that are down or already tried (not candidates) and holders at the cap
    are never scored, whether they hold the prefix or are drawn."""
    p = policy(concurrency_threshold=4)
    members = [B(f"b{i}", inflight=i % 5) for i in range(64)]
    out = {f"b{i}" for i in range(0, 64, 3)}
    candidates = tuple(b for b in members if b.name not in out)
    excluded = FleetView(tuple(members), candidates, frozenset(b.name for b in candidates))
    for name in ("b0", "b3", "b4", "b5"):  # two out of the view, one at the cap, one fine
        hold(p, name, 500)
    full = {b.name for b in members if b.inflight >= 4} | out
    for i in range(200):
        req = request() if i % 2 else _new_prompt(i)
        pick = p.pick(req, excluded)
        assert not set(p.recent[-1]["scores"]) & full, p.recent[-1]["scores"]
        assert pick.backend.name not in full
    assert p.pick(request(), excluded).backend.name == "b5"


def test_pruned_draws_again_under_the_cap_when_every_draw_is_full() -> None:
    """60 of 64 backends at the cap: when the draws all land on them, the pick draws
    among the four under it rather than calling the fleet saturated."""
    p = policy(concurrency_threshold=2)
    members = [B(f"b{i}", inflight=2 if i >= 4 else 0) for i in range(64)]
    picks = [p.pick(_new_prompt(i, 800), view(members)) for i in range(1, 101)]
    assert {pick.backend.name for pick in picks} <= {"b0", "b1", "b2", "b3"}
    assert all(pick.reason is Reason.KV_COLD for pick in picks)


def test_a_small_fleet_is_scored_whole() -> None:
    """A fleet no larger than the holders plus `sample`, or than `WHOLE` candidates
    (3 draws of 4 would leave the least loaded out of one cold pick in four), scores
    every candidate, as sample 0 does at any size; past it, the draws."""
    p = policy()
    members = [B(n) for n in "abcd"]
    hold(p, "a", 100)
    p.pick(request(), view(members))
    assert set(p.recent[-1]["scores"]) == set("abcd")
    for size, scored in ((WHOLE, WHOLE), (WHOLE + 1, 3)):
        p = policy()
        members = _fleet(size, 0)
        pick = p.pick(request(), view(members))
        assert len(p.recent[-1]["scores"]) == scored, size
        if size == WHOLE:  # the exhaustive pick
            assert pick.backend is policy(sample=0).pick(request(), view(members)).backend
    p = policy(sample=0)
    members = _fleet(256, 1)
    p.pick(request(), view(members))
    assert len(p.recent[-1]["scores"]) == 256


def test_sample_zero_picks_the_minimum_over_every_candidate() -> None:
    """sample 0 is the exhaustive pick, from the scores it records of every candidate:
    among those within tie_fraction of the lowest cost but its decode, one holding the
    longest prefix."""
    for trial in range(20):
        members = _fleet(64, trial)
        p = policy(sample=0)
        hold(p, f"b{trial}", 200 + trial)
        pick = p.pick(request(), view(members))
        scores = p.recent[-1]["scores"]
        assert len(scores) == 64
        best = min(scores, key=lambda n: scores[n]["cost_s"])
        running = next(b.inflight for b in members if b.name == best)
        decode = 256 * (0.025 + 0.00015 * (running + 1))  # the answer's, at the defaults
        limit = scores[best]["cost_s"] * 1.1 - decode * 0.1 + 1e-6
        ties = [n for n, s in scores.items() if s["cost_s"] <= limit]
        most = max(scores[n]["cached"] for n in ties)
        assert pick.backend.name in ties and pick.predicted_cached == most, trial


class Placed:
    """Another worker's placement of the whole prompt on `name`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def place(self, backend: str, keys, start: int, expires_at: float) -> None:
        pass

    def held(self, keys, start: int):
        return self.name, len(keys) - start, float("inf")


def test_pruned_adopts_a_placement_on_a_backend_it_did_not_draw() -> None:
    members = [B(f"b{i}") for i in range(64)]
    for target in members:
        p = policy()
        p.share(Placed(target.name))
        pick = p.pick(request(), view(members))
        assert (pick.backend.name, pick.reason) == (target.name, Reason.KV_HIT)


def test_a_new_prompt_does_not_queue_behind_a_prefill_to_spare_a_stream() -> None:
    """A new 1,100-token prompt, 100 tokens expected: `queued` has another new prompt
    waiting for its prefill beside 4 streams, `busier` 6 streams and nothing queued. At
    the fleet's total latency (`harm_weight` 1) sparing one request more a 110 ms step
    outweighs this prompt waiting 110 ms for its first token; at the default weight it
    does not."""
    req = RouteRequest("m", 0, chain(ROOT, list(range(50_000, 51_100)), 16), 1100, 100)
    members = [B("queued", inflight=5, queued_tokens=1100), B("busier", inflight=6)]
    assert policy(harm_weight=1.0).pick(req, view(members)).backend.name == "queued"
    assert policy().pick(req, view(members)).backend.name == "busier"


def test_of_tied_cold_candidates_the_sooner_first_token_wins() -> None:
    """Two cold candidates cost the fleet the same within `tie_seconds` (50 ms here):
    `queued` has two streams fewer but its first token waits for another prompt's prefill
    (110 ms), `sooner` has nothing queued. The emptiest cache would pick `queued`
    (`sooner` holds another document); the user's first token picks `sooner`."""
    req = RouteRequest("m", 0, chain(ROOT, list(range(50_000, 51_100)), 16), 1100, 100)
    p = policy(tie_seconds=0.05)
    hold(p, "sooner", 100)
    queued = B("queued", inflight=3, queued_tokens=1100)
    sooner = B("sooner", inflight=5)
    chosen = p.pick(req, view([queued, sooner])).backend.name
    scores = p.recent[-1]["scores"]
    assert abs(scores["queued"]["cost_s"] - scores["sooner"]["cost_s"]) < 0.05, scores
    assert scores["sooner"]["ttft_s"] < scores["queued"]["ttft_s"] - 0.1, scores
    assert chosen == "sooner", scores


def offload(p, backend: str, blocks: int, medium: str = "cpu") -> None:
    """`backend` holds the first `blocks` blocks on an offload tier, and not on its GPU."""
    p.index.stored(backend, medium, None, list(range(blocks)), IDS[: blocks * 16], 16, ROOT)


def test_a_prefix_on_the_cpu_tier_is_cheaper_than_a_miss_dearer_than_a_hit() -> None:
    p = policy()
    offload(p, "a", 500)
    pick = p.pick(request(), view([B("b"), B("a")]))
    assert (pick.backend.name, pick.reason, pick.predicted_cached) == ("a", Reason.KV_TIER, 8000)
    score = p.recent[-1]["scores"]["a"]
    # its TTFT: the load and one decode step; its decode: 256 expected tokens' steps
    assert score == {
        "cost_s": pytest.approx(8000 * 1.6e-6 + 0.025 + 256 * (0.025 + 0.00015)),
        "ttft_s": pytest.approx(8000 * 1.6e-6 + 0.025),
        "cached": 8000,
        "gpu": 0,
        "tiers": {"cpu": 8000},
    }
    p = policy()
    offload(p, "a", 500)
    hold(p, "c", 500)
    assert p.pick(request(), view([B("a"), B("c")])).backend.name == "c"  # a hit beats a load


def test_the_gpu_part_is_a_hit_and_the_tier_adds_what_follows() -> None:
    p = policy()
    hold(p, "a", 200)
    offload(p, "a", 500)
    hold(p, "b", 300)
    pick = p.pick(request(), view([B("a"), B("b")]))
    assert (pick.backend.name, pick.reason) == ("a", Reason.KV_TIER)
    assert p.recent[-1]["scores"]["a"]["tiers"] == {"cpu": 8000 - 3200}
    assert p.recent[-1]["scores"]["b"]["tiers"] == {"cpu": 0}


def test_tier_blind_scores_the_gpu_only() -> None:
    p = policy(tiers={})
    offload(p, "a", 500)
    assert p.index.ignored == {"cpu": 1}
    pick = p.pick(request(), view([B("a"), B("b")]))
    assert pick.reason is Reason.KV_COLD and "tiers" not in p.recent[-1]["scores"]["a"]


def test_a_shared_tier_serves_every_backend_at_its_cost() -> None:
    p = policy(tiers={"remote": KvTierParams(load_s_per_token=2e-5, shared=True)})
    offload(p, "a", 500, "remote")
    busy = B("a", queued_tokens=40_000)
    pick = p.pick(request(), view([busy, B("b")]))
    assert (pick.backend.name, pick.reason, pick.predicted_cached) == ("b", Reason.KV_TIER, 8000)


def test_pruned_scoring_finds_the_tier_holders() -> None:
    p = policy()
    members = _fleet(256, 0)
    offload(p, "b77", 500)
    pick = p.pick(request(), view(members))
    assert pick.backend.name == "b77" and len(p.recent[-1]["scores"]) == 1 + 3


@pytest.mark.parametrize("medium", ["gpu", "CPU"])
def test_tier_names_are_lowercase_media_other_than_the_gpu(medium: str) -> None:
    with pytest.raises(msgspec.ValidationError, match="lowercase"):
        msgspec.convert(
            {"strategy": "KV_AWARE", "tiers": {medium: {"load_s_per_token": 1e-6}}},
            KvAwareParams,
        )


SYSTEM = list(range(500))  # the system prompt every conversation starts with


def _turn(conversation: int, turn: int) -> RouteRequest:
    """A conversation's prompt at `turn`: the shared system prompt, then its history."""
    ids = SYSTEM + [1_000_000 * (conversation + 1) + t for t in range(150 * (turn + 1))]
    return RouteRequest("m", 0, chain(ROOT, ids, 16), len(ids), 100)


def test_an_idle_backend_takes_new_conversations() -> None:
    """Three backends hold the shared system prompt and decode batches; the fourth holds
    nothing and idles: a new conversation goes there, its prefill of the system prompt
    costing less than what it would cost the batches and itself elsewhere."""
    p = policy()
    members = [B("a", inflight=6), B("b", inflight=6), B("c", inflight=6), B("d")]
    for name in "abc":
        hold(p, name, len(SYSTEM) // 16)
    pick = p.pick(_turn(7, 0), view(members))
    assert (pick.backend.name, pick.reason) == ("d", Reason.KV_COLD)


def test_conversations_behind_one_system_prompt_use_every_backend() -> None:
    """80 conversations of 3 turns behind one system prompt, 16 requests in flight at
    a time: every backend carries its share (none under half the mean, none over 1.5x),
    and each conversation's later turns stay where its history is."""
    p = policy()
    members = [B(n) for n in "abcd"]
    order = [(c, t) for t in range(3) for c in range(80)]
    random.Random(5).shuffle(order)
    order.sort(key=lambda ct: ct[1])  # a conversation's turns in order
    inflight: collections.deque = collections.deque()
    homes: dict[int, set[str]] = collections.defaultdict(set)
    for c, t in order:
        if len(inflight) == 16:
            inflight.popleft().inflight -= 1
        backend = p.pick(_turn(c, t), view(members)).backend
        backend.inflight += 1
        inflight.append(backend)
        homes[c].add(backend.name)
    counts = collections.Counter(name for names in homes.values() for name in names)
    mean = sum(counts.values()) / len(members)
    assert all(0.5 * mean <= counts[b.name] <= 1.5 * mean for b in members), counts
    assert sum(len(names) == 1 for names in homes.values()) >= 2 * len(homes) // 3  # sticky


def test_a_prefix_moves_off_its_backend_once_staying_costs_more() -> None:
    """The holder keeps the prefix while its batch is small and loses it once staying
    costs more than prefilling it on an idle backend, the decision the scores show; a
    slower holder (its learned speed) loses it sooner."""

    def moves_at(speed: Speed | None) -> int:
        for running in range(200):
            p = policy()
            hold(p, "a", 500)
            holder = B("a", inflight=running)
            holder.speed = speed
            pick = p.pick(request(), view([holder, B("b")]))
            if pick.backend.name == "b":
                scores = p.recent[-1]["scores"]
                assert scores["a"]["cost_s"] > scores["b"]["cost_s"]
                return running
        raise AssertionError("never moved")

    configured = moves_at(None)
    assert configured >= 4  # sticky: a few requests in flight do not move it
    assert moves_at(Speed(10_000.0, 0.025, 0.0006)) < configured


def test_a_new_prompt_goes_where_a_cache_that_proved_small_has_room() -> None:
    """Two backends whose caches keep 100 blocks: "a" holds another prompt's 100, "b"
    nothing but a little queue. A new prompt of 100 blocks would evict the other prompt
    on "a", so it goes to "b", once answers proved a cache keeps 100: each backend's own,
    or for "a", before its own, the fleet's typical bound ("b"'s). While nothing is
    learned (the caches' size unknown), or at `eviction_penalty: 0`, it goes to the
    idler "a"."""
    other = chain(ROOT, list(range(10**6, 10**6 + 1600)), 16)
    ids = list(range(1600))
    req = RouteRequest("m", 0, chain(ROOT, ids, 16), len(ids))
    cases = [("ab", 1.0, "b"), ("b", 1.0, "b"), ("", 1.0, "a"), ("ab", 0.0, "a")]
    for learned, penalty, expected in cases:
        p = policy(eviction_penalty=penalty)
        p.index.gpu.learn("a", other, 1e9)
        for name in learned:
            p.index.gpu.trust(name, 100)
        pick = p.pick(req, view([B("a"), B("b", queued_tokens=800)]))
        assert pick.backend.name == expected, (learned, penalty, p.recent[-1]["scores"])


def test_new_documents_on_an_idle_fleet_fill_the_emptiest_caches() -> None:
    """Six new documents, one at a time on an idle fleet of three: every one ties, and
    each goes to the emptiest cache, two per backend (an engine that keeps two prompts
    then keeps them all), where the rendezvous winner of each one's first block would
    put four on one backend. Where a cache proved smaller, the room it has decides."""
    docs = [_new_prompt(i, 1400) for i in range(30, 36)]
    p = policy()
    placed = collections.Counter(p.pick(d, view([B(n) for n in "abc"])).backend.name for d in docs)
    assert sorted(placed.values()) == [2, 2, 2], placed
    small = policy()
    small.index.gpu.trust("a", 50)
    small.index.gpu.trust("b", 200)
    small.index.gpu.trust("c", 200)
    first = [small.pick(d, view([B(n) for n in "abc"])).backend.name for d in docs[:2]]
    assert "a" not in first and len(set(first)) == 2, first


def _long_prompt(first: int, blocks: int = 2048) -> RouteRequest:
    ids = list(range(first, first + blocks * 16))
    return RouteRequest("m", 0, chain(ROOT, ids, 16), len(ids))


def _held(p, backend: str, req: RouteRequest) -> list[int]:
    """The indexes of `req`'s blocks that `backend` holds in the index."""
    gpu = p.index.gpu
    return [i for i, key in enumerate(req.blocks) if gpu.expiry(backend, key) is not None]


def test_a_paced_pick_inserts_its_first_slice_and_drains_the_rest_in_prefix_order() -> None:
    p = policy()
    p.pace(256)
    req = _long_prompt(0)
    name = p.pick(req, view([B("a")])).backend.name
    assert _held(p, name, req) == list(range(256)) and p.deferred
    drained = 256
    while p.drain():
        drained += 256
        assert _held(p, name, req) == list(range(drained))  # a prefix, never a hole
    assert _held(p, name, req) == list(range(2048)) and not p.deferred


def test_unpaced_and_short_picks_insert_everything_at_once() -> None:
    unpaced, paced = policy(), policy()
    paced.pace(256)
    long, short = _long_prompt(0), _long_prompt(10**6, 256)
    assert len(_held(unpaced, unpaced.pick(long, view([B("a")])).backend.name, long)) == 2048
    assert len(_held(paced, paced.pick(short, view([B("a")])).backend.name, short)) == 256
    assert not paced.deferred and not paced.drain()


def test_a_repeated_paced_prompt_takes_its_pending_rest_over() -> None:
    p = policy()
    p.pace(256)
    req = _long_prompt(0)
    p.pick(req, view([B("a")]))
    p.drain()
    pick = p.pick(req, view([B("a")]))
    assert pick.predicted_cached == 512 * 16
    assert len(p._upkeep.pending) == 1  # the second pick's rest replaced the first's
    while p.drain():
        pass
    assert _held(p, "a", req) == list(range(2048))


def test_a_backend_that_leaves_drops_its_pending_slices() -> None:
    p = policy()
    p.pace(256)
    members = [B("a"), B("b")]
    first = p.pick(_long_prompt(0), view(members)).backend.name
    p.on_fleet_change(tuple(b for b in members if b.name != first))
    assert not p.deferred and not p.drain()


def test_past_max_pending_a_pick_inserts_the_oldest_backlog_itself() -> None:
    from policies.kv_aware.upkeep import MAX_PENDING

    p = policy()
    p.pace(256)
    reqs = [_long_prompt(i * 10**6) for i in range(MAX_PENDING + 3)]
    for req in reqs:
        p.pick(req, view([B("a")]))
    assert len(p._upkeep.pending) == MAX_PENDING
    assert all(len(_held(p, "a", req)) == 2048 for req in reqs[:3])
    assert all(_held(p, "a", req) == list(range(256)) for req in reqs[3:])
