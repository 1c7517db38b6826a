"""KV_AWARE: the backend where the whole request costs the fleet least, from its real cache.

For each candidate b, in seconds, with p(b) its prefill rate and step(b, r) = a(b) +
c(b) x r its decode step with r requests in its batch:

    prefill(b) = uncached(b) / p(b) + loaded(b)
    ttft(b)    = queued_tokens(b) / p(b) + prefill(b) + step(b, inflight(b))
                 + waiting_s_per_request * waiting(b)
    decode(b)  = output_tokens * step(b, inflight(b) + 1)
    harm(b)    = inflight(b) * (prefill(b) + output_tokens * c(b) / 2)
    cost(b)    = ttft(b) + decode(b) + harm(b) + miss_penalty * uncached(b) / p(b)

- uncached(b) = prompt tokens minus the longest prefix b reaches, in blocks, from the
  prefix index (fed by b's KV events, or learned from our own routing when b publishes
  none): on its GPU, or beyond that on an offload tier;
- loaded(b) = the tokens b reaches on offload tiers only, each at its tier's
  `load_s_per_token` (cheapest tier first: CPU memory, storage, a shared remote store
  that every backend reads). A prefix the GPU evicted but the CPU kept is cheaper than a
  miss and dearer than a hit. KV events name each block's medium (hashing/tiered_index.py);
  a medium not in `tiers` is not indexed (counted in /debug/routing's `ignored_media`),
  and `tiers: {}` scores the GPU alone;
- queued_tokens(b) = uncached prompt tokens the router has sent to b whose first token
  has not come back yet (this router's, every worker's, exact: the fast signal);
- waiting(b) = b's scraped `vllm:num_requests_waiting` (fleet-wide, shared by every router
  replica; 0 when stale);
- inflight(b) = this router's in-flight requests, all workers: the batch it decodes;
- output_tokens = the request's `max_tokens`, else the median answer the router saw for
  its model, else `output_tokens`;
- p(b), a(b), c(b) = b's `speed` as the router learned it (router/fleet/speeds.py: from
  the time to first token against the tokens prefilled, and the inter-token gaps of the
  streams it relayed against the batch they shared), or the configured
  `prefill_tokens_per_s`, `decode_step_s` and `decode_s_per_request` until it has.

`harm` is what the request costs the requests already decoding there: chunked prefill
puts its prompt into their steps, and its sequence makes their steps longer (for about
half its decode: they are halfway through theirs, on average).
The miss penalty is what it costs those that will queue behind its prefill (1.0: a
backend that would prefill a prompt another holds must save more than the prefill it
adds). So a prefix stays where it is cached while staying costs less than moving it,
and moves once the holder's batch makes it dearer; an idle backend has no batch to
harm and its steps are the shortest, so new conversations go there even when all
share a system prompt the busy ones hold. The minimum wins. Candidates within
`tie_seconds` of it, or `tie_fraction` of its cost but its own decode, tie; among them the
one holding the longest prefix wins (a hit saves the fleet a prefill), and equal
holders go to the rendezvous-hash winner of the prompt's first block that none of them
holds (hashing/rendezvous.py).

A prompt cached nowhere goes where it costs least, tied only within `tie_seconds` (every
gap between cold candidates is load, so a wider tie would send it behind another
prefill), and exact ties to the rendezvous winner of its first block. Every worker sees
the same load table and placements, so the workers of one router place a new prefix
alike; replicas place it alike while their estimates tie (an idle or evenly loaded
fleet) and otherwise each by its own queues: with KV events on, every replica then
learns where the others put it from the backends themselves. A hot prefix spreads by
itself: once its holders' queues and batches cost more than a cold backend's full prefill
plus the miss penalty, the next request goes to another backend, which then holds the
prefix too (the speculative insert keeps a burst together there until its KV events
confirm it), so the holder set grows only as demand needs. `concurrency_threshold` is a
hard cap: backends at it are skipped unless all are (then the least loaded, ties at
random); `max_queue_s` caps a backend's estimated queue the same way (the work ahead of
a new request, in seconds). Either cap is KV_AWARE's saturation point, where a fleet
with pools passes a request to the next pool.

With several worker processes, each decision is also written to the router's shared
placements (`share`, router/fleet/placements.py) before `pick` returns, and each pick first
reads there whether another worker just sent this prompt's uncached blocks somewhere,
the router holding a router-wide lock around the pick and its load count: a burst of
one new prefix that the kernel spread over the workers stays on one backend, as it
would in one process.

Only the candidates that can matter are scored (`sample` > 0, the default): the backends
holding the prompt's longest prefixes, which the index names without visiting the others
(at most 8 on the GPU and 8 per local offload tier; `PrefixIndex.holders`; a shared tier
reaches every backend, drawn ones included), plus `sample` others drawn uniformly from the
candidates ("power of k choices"; each is scored like the holders, so the least loaded of
them is the cold choice, and one that holds a shorter prefix gets its credit). The draws
are seeded by the first block no backend holds, so every worker and replica scores the same
backends for the same prompt and still places a new prefix alike, while different prompts
spread over the whole fleet. A fleet no larger than the holders plus `sample` is scored
whole. The pick equals the exhaustive one whenever it goes to a holder; a cold prompt goes
to the least loaded of its draws instead of the fleet's least loaded. If every scored
backend is at `concurrency_threshold`, the draws are made again among those under it.
`sample: 0` scores every candidate.

Reads: RouteRequest.blocks/prompt_tokens/output_tokens, candidates' inflight,
queued_tokens, waiting, speed.
Cost: O((holders + sample) * log blocks) for the lookups, whatever the fleet size
(O(candidates * log blocks) with `sample: 0`, and one O(candidates) filter when every
scored backend is at the cap); keys are cached by prefix in hashing/; one shared-placement
probe and one rendezvous rank per tied candidate. The whole-request cost adds a few
float operations per scored candidate to the lookups (bench/test_bench_routing.py).

Parameters (defaults): block_size (16, the backends' KV block size), tokenizer ({kind:
chatml4}, or {kind: hf, path: /models/llama} for vLLM), max_prefix_tokens (32768),
prefill_tokens_per_s (10000), decode_step_s (0.025), decode_s_per_request (0.00015),
output_tokens (256), waiting_s_per_request (0.05), miss_penalty (1.0), tie_fraction
(0.1), tie_seconds (0.005), concurrency_threshold (null), max_queue_s (null),
speculative_ttl_s (2.0, when the backend publishes events), approximate_ttl_s (600, when
it does not), index_capacity (1_000_000 keys per backend and medium), sample (3; 0
scores every candidate), tiers ({cpu: {load_s_per_token: 1.6e-6}, storage:
{load_s_per_token: 1.3e-5}}, sources at DEFAULT_TIERS; `shared: true` marks a store
every backend reads), seed.
YAML:
  routing: {strategy: KV_AWARE, block_size: 16, prefill_tokens_per_s: 10000, sample: 3}
"""

from __future__ import annotations

import operator
import random
import time
from collections import deque
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from hashing.chat_tokens import PromptBlocks, make_prompt_blocks
from hashing.rendezvous import name_hash, score
from hashing.tiered_index import Reach, Tier, TieredIndex
from policies.base import (
    BackendLike,
    FleetView,
    Pick,
    Placements,
    Policy,
    PolicyParams,
    Reason,
    RouteRequest,
)
from policies.least_outstanding_requests import least_loaded
from policies.registry import register

Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]


class KvTokenizerParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The backends' exact tokenizer: "hf" (a local HuggingFace tokenizer directory with
    its chat template) for vLLM, "backend" (ask a backend's POST /tokenize, cached; costs
    a round trip per new prompt), or "chatml4" (`kvroute sim`'s)."""

    kind: Literal["chatml4", "hf", "backend"] = "chatml4"
    path: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "hf" and not self.path:
            raise ValueError("tokenizer.kind 'hf' needs tokenizer.path (a tokenizer directory)")


class KvTierParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """An offload tier, named by the KV events' medium (lowercase): what loading one of its
    tokens into the GPU costs, and whether every backend reads it (a remote store) or only
    the backend that stored it."""

    load_s_per_token: NonNegative
    shared: bool = False


#: The offload tiers vLLM's connectors publish, priced for the hardware the other defaults
#: describe (prefill_tokens_per_s 10,000: Llama-3.1-70B BF16 on 8 A100s). A token's KV is
#: 320 KiB, 40 KiB per GPU. From CPU memory each GPU loads its share over its own PCIe Gen4
#: x16 link (~25 GB/s): 1.6 µs, a 60th of a prefilled token. From local storage, four Gen4
#: NVMe drives (~6.5 GB/s each) read 320 KiB in ~13 µs, an eighth of a prefilled token.
DEFAULT_TIERS = {
    "cpu": KvTierParams(load_s_per_token=1.6e-6),
    "storage": KvTierParams(load_s_per_token=1.3e-5),
}


class KvAwareParams(PolicyParams, tag="KV_AWARE"):
    #: a pool's hardware sets its speeds and its caps; blocks, tokenizer, index and
    #: tiers describe what every pool shares
    pool_tunable = frozenset(
        {
            "prefill_tokens_per_s",
            "decode_step_s",
            "decode_s_per_request",
            "waiting_s_per_request",
            "miss_penalty",
            "tie_fraction",
            "tie_seconds",
            "concurrency_threshold",
            "max_queue_s",
            "sample",
        }
    )
    block_size: Annotated[int, Meta(ge=1, le=4096)] = 16
    tokenizer: KvTokenizerParams = KvTokenizerParams()
    max_prefix_tokens: Annotated[int, Meta(ge=1)] = 32768
    prefill_tokens_per_s: Positive = 10000.0
    #: a decode step's duration, alone and per request in the batch (the priors of the
    #: learned speeds): the reference hardware's (bench/sim/params.py)
    decode_step_s: NonNegative = 0.025
    decode_s_per_request: NonNegative = 0.00015
    #: the answer's expected tokens when neither the request nor the router's past
    #: answers say
    output_tokens: Annotated[int, Meta(ge=0)] = 256
    waiting_s_per_request: NonNegative = 0.05
    miss_penalty: NonNegative = 1.0
    tie_fraction: NonNegative = 0.1
    tie_seconds: NonNegative = 0.005
    concurrency_threshold: Annotated[int, Meta(ge=1)] | None = None
    max_queue_s: Positive | None = None
    speculative_ttl_s: Positive = 2.0
    approximate_ttl_s: Positive = 600.0
    index_capacity: Annotated[int, Meta(ge=1)] = 1_000_000
    sample: Annotated[int, Meta(ge=0)] = 3
    tiers: dict[str, KvTierParams] = msgspec.field(default_factory=lambda: dict(DEFAULT_TIERS))
    seed: Annotated[int, Meta(ge=0)] | None = None

    def __post_init__(self) -> None:
        for medium in self.tiers:
            if medium != medium.lower() or medium == "gpu":
                raise ValueError(
                    f"tiers: {medium!r}: name an offload medium in lowercase as the KV "
                    "events do (cpu, storage, ...); the GPU is not a tier"
                )


#: (estimated cost to the fleet, prompt tokens it need not prefill, backend, of them on
#: its GPU, tokens it reaches on its GPU and each tier of the request's `Reach`,
#: cumulative; estimated TTFT; the cost but its own decode)
_Scored = tuple[float, int, BackendLike, int, tuple[int, ...], float, float]

#: at most this many holders of the longest prefixes are scored (the rest are drawn)
_HOLDERS = 8
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX = 0xBF58476D1CE4E5B9


_first = operator.itemgetter(0)


def _attr(backend: BackendLike, name: str) -> float:
    return getattr(backend, name, 0) or 0


@register
class KvAwarePolicy(Policy[KvAwareParams]):
    use_when = "in doubt (the default): shared prefixes, long prompts, uneven load"

    def __init__(self, params: KvAwareParams) -> None:
        super().__init__(params)
        tiers = [Tier(m, t.load_s_per_token, t.shared) for m, t in params.tiers.items()]
        self.index = TieredIndex(params.index_capacity, tiers)
        self._gpu = self.index.gpu
        #: backends that publish KV events; the others are indexed from our own decisions
        #: (none: the block keys need no token ids)
        self.event_backends: set[str] = set()
        max_blocks = params.max_prefix_tokens // params.block_size
        tok = params.tokenizer
        self._blocks = make_prompt_blocks(
            params.block_size, max_blocks, tok.kind, tok.path, self.event_backends
        )
        self._rng = random.Random(params.seed)
        #: the last decisions as recorded (see `recent`)
        self._recent: deque[tuple] = deque(maxlen=64)
        #: each backend's rendezvous identity, by name (memoised: names are few)
        self._hashes: dict[str, int] = {}
        self._shared: Placements | None = None
        #: the members by name, for the holders the index names (rebuilt when they change)
        self._members: tuple[BackendLike, ...] = ()
        self._named: dict[str, BackendLike] = {}

    @property
    def block_keys(self) -> PromptBlocks:
        return self._blocks

    def on_fleet_change(self, members: tuple[BackendLike, ...]) -> None:
        names = {m.name for m in members}
        for gone in self.event_backends - names:
            self.index.forget(gone)
        self._hashes = {name: h for name, h in self._hashes.items() if name in names}

    def share(self, placements: Placements) -> None:
        self._shared = placements

    def pick(self, req: RouteRequest, fleet: FleetView) -> Pick:
        if not fleet.candidates:
            return Pick(None, Reason.NO_CANDIDATE)
        reach = self.index.reach()
        scored = self._scored(req, fleet, reach)
        if not scored:
            return Pick(least_loaded(fleet.candidates, self._rng), Reason.ALL_SATURATED)
        if self._shared is not None:
            self._adopt_placement(req, fleet, scored, reach)
        _, covered, backend, cached, *_ = self._agreed(req, self._ties(scored))
        self._learn(req, backend, cached)
        self._record(req, backend, scored, reach)
        return Pick(backend, _reason(covered, cached), covered)

    def _ties(self, scored: list[_Scored]) -> list[_Scored]:
        """The candidates tied for the lowest cost (within `tie_seconds`, or warm within
        `tie_fraction` of the best one's cost but its own decode: the decode every
        candidate adds is no reason to tie wider), narrowed to those of them holding the
        longest prefix."""
        p = self.params
        best = min(scored, key=_first)
        warm = any(s[1] for s in scored)
        limit = best[0] + (max(p.tie_seconds, best[6] * p.tie_fraction) if warm else p.tie_seconds)
        ties = [s for s in scored if s[0] <= limit]
        most = max(s[1] for s in ties)
        return [s for s in ties if s[1] == most]

    def _scored(self, req: RouteRequest, fleet: FleetView, reach: Reach) -> list[_Scored]:
        """The estimates of the candidates under the cap that can matter (see above)."""
        sample = self.params.sample
        if sample:
            held = self._gpu.holders(req.blocks, _HOLDERS)
            if reach:
                held = self._with_tier_holders(req, held, reach)
            if len(fleet.candidates) > len(held) + sample:
                return self._pruned(req, fleet, held, reach)
        return [self._score(req, b, reach) for b in self._under_cap(fleet.candidates)]

    def _with_tier_holders(
        self, req: RouteRequest, held: list[tuple[str, int]], reach: Reach
    ) -> list[tuple[str, int]]:
        """`held` (GPU holders and their blocks) and the holders on the local tiers of
        `reach`, with the blocks their GPU holds."""
        known = {name for name, _ in held}
        more = self.index.tier_holders(req.blocks, _HOLDERS, reach) - known
        return held + [(name, self._gpu.longest_prefix(req.blocks, name)) for name in more]

    def _pruned(
        self, req: RouteRequest, fleet: FleetView, held: list[tuple[str, int]], reach: Reach
    ) -> list[_Scored]:
        """The holders that are candidates under the cap, and `sample` draws beside them."""
        named, names = self._by_name(fleet.members), fleet.candidate_names
        scored = []
        for name, blocks in held:
            backend = named.get(name)
            if backend is not None and name in names and self._fits(backend):
                scored.append(self._estimate(req, backend, blocks, reach))
        deepest = max((blocks for _, blocks in held), default=0)
        seed = req.blocks[deepest] if deepest < len(req.blocks) else self._rng.getrandbits(64)
        taken = {s[2].name for s in scored}
        drawn = self._draws(req, fleet.candidates, seed, taken, reach)
        if not scored and not drawn:  # every one scored is at the cap: draw among the others
            pool = tuple(self._under_cap(fleet.candidates))
            drawn = self._draws(req, pool, seed, taken, reach)
        return scored + drawn

    def _draws(
        self,
        req: RouteRequest,
        pool: tuple[BackendLike, ...],
        seed: int,
        taken: set[str],
        reach: Reach,
    ) -> list[_Scored]:
        """Up to `sample` backends of `pool` under the cap and not `taken`, drawn by `seed`
        (at most twice as many draws, so a pool mostly taken or full costs no more)."""
        want, n = self.params.sample, len(pool)
        drawn: list[_Scored] = []
        for j in range(2 * want):
            if len(drawn) == want or not n:
                break
            backend = pool[(((seed + j * _GOLDEN) * _MIX) & _MASK) * n >> 64]
            if backend.name not in taken and self._fits(backend):
                taken.add(backend.name)
                drawn.append(self._score(req, backend, reach))
        return drawn

    def _by_name(self, members: tuple[BackendLike, ...]) -> dict[str, BackendLike]:
        if members is not self._members:
            self._members, self._named = members, {b.name: b for b in members}
        return self._named

    def _adopt_placement(
        self, req: RouteRequest, fleet: FleetView, scored: list[_Scored], reach: Reach
    ) -> None:
        """Take another worker's recent placement of the blocks no candidate holds here:
        its backend holds them (speculatively) for this pick and the ones after it."""
        start = max(s[3] for s in scored) // self.params.block_size
        if start >= len(req.blocks):
            return
        found = self._shared.held(req.blocks, start)
        if found is None:
            return
        name, count, expires_at = found
        backend = self._by_name(fleet.members).get(name)
        if backend is None or name not in fleet.candidate_names or not self._fits(backend):
            return
        self._gpu.learn(name, req.blocks[start : start + count], expires_at)
        rescored = self._score(req, backend, reach)
        for i, s in enumerate(scored):
            if s[2].name == name:
                scored[i] = rescored
                return
        scored.append(rescored)  # pruned: not among those scored before

    def _agreed(self, req: RouteRequest, ties: list[_Scored]) -> _Scored:
        """The rendezvous winner of the first block the ties do not hold: the same on
        every worker and replica; a prompt without such a block draws at random."""
        if len(ties) == 1:
            return ties[0]
        first_new = ties[0][1] // self.params.block_size
        if first_new >= len(req.blocks):
            return ties[self._rng.randrange(len(ties))]
        key = req.blocks[first_new]
        return max(ties, key=lambda s: score(key, self._hash(s[2].name), s[2].weight))

    def _hash(self, name: str) -> int:
        found = self._hashes.get(name)
        if found is None:
            found = self._hashes[name] = name_hash(name)
        return found

    def _under_cap(self, candidates: tuple[BackendLike, ...]) -> list[BackendLike]:
        p = self.params
        if p.concurrency_threshold is None and p.max_queue_s is None:
            return list(candidates)
        return [b for b in candidates if self._fits(b)]

    def _fits(self, backend: BackendLike) -> bool:
        """Below the caps: `concurrency_threshold` requests in flight, and `max_queue_s`
        of estimated queue (the work ahead of a new request: queued prompt tokens at
        the prefill rate, the running and the waiting requests)."""
        p = self.params
        cap = p.concurrency_threshold
        if cap is not None and backend.inflight >= cap:
            return False
        return p.max_queue_s is None or self._queue_s(backend) <= p.max_queue_s

    def _queue_s(self, backend: BackendLike) -> float:
        """The work ahead of a new request on `backend`, in seconds: the terms of
        `_estimate`'s TTFT but the request's own, which `_estimate` keeps inline (it runs
        for every candidate of every pick; a call more there costs µs at 1,024 backends)."""
        p = self.params
        rate, _, per_request = self._speed(backend)
        return (
            _attr(backend, "queued_tokens") / rate
            + per_request * backend.inflight
            + p.waiting_s_per_request * _attr(backend, "waiting")
        )

    def _speed(self, backend: BackendLike) -> tuple[float, float, float]:
        """`backend`'s learned speed, or the configured one until the router learned it."""
        learned = getattr(backend, "speed", None)
        if learned is not None:
            return learned
        p = self.params
        return p.prefill_tokens_per_s, p.decode_step_s, p.decode_s_per_request

    def _score(self, req: RouteRequest, backend: BackendLike, reach: Reach) -> _Scored:
        blocks = self._gpu.longest_prefix(req.blocks, backend.name)
        return self._estimate(req, backend, blocks, reach)

    def _estimate(
        self, req: RouteRequest, backend: BackendLike, blocks: int, reach: Reach
    ) -> _Scored:
        """The estimate for `backend`, holding the first `blocks` blocks of the prompt on
        its GPU and, beyond them, what it reaches on the tiers of `reach` at their cost
        (cheapest first: a block is loaded from the cheapest tier that has it)."""
        p = self.params
        prompt = req.prompt_tokens
        cached = covered = min(prompt, blocks * p.block_size)
        load, tiers = 0.0, ()
        if reach:
            reached = self.index.tier_blocks(req.blocks, backend.name, blocks, reach)
            tiers = tuple(min(prompt, n * p.block_size) for n in reached)
            for (tier, _), tokens in zip(reach, tiers, strict=True):
                load += (tokens - covered) * tier.load_s_per_token
                covered = tokens
        rate, step, per_request = self._speed(backend)
        running = backend.inflight
        output = req.output_tokens or p.output_tokens
        prefill = (prompt - covered) / rate + load
        ttft = (
            _attr(backend, "queued_tokens") / rate
            + prefill
            + step
            + per_request * running
            + p.waiting_s_per_request * _attr(backend, "waiting")
        )
        decode = output * (step + per_request * (running + 1))
        harm = running * (prefill + output * per_request / 2)
        cost = ttft + decode + harm + p.miss_penalty * (prompt - covered) / rate
        return cost, covered, backend, cached, tiers, ttft, cost - decode

    def _learn(self, req: RouteRequest, backend: BackendLike, cached: int) -> None:
        """Speculative insert: the blocks we send are about to be cached there.

        Only the blocks past the cached prefix are inserted, so a hit costs O(new blocks).
        """
        p = self.params
        new = req.blocks[cached // p.block_size :]
        if not new:
            return
        ttl = p.speculative_ttl_s if backend.name in self.event_backends else p.approximate_ttl_s
        expires_at = time.monotonic() + ttl
        self._gpu.learn(backend.name, new, expires_at)
        if self._shared is not None:
            self._shared.place(backend.name, req.blocks, cached // p.block_size, expires_at)

    def _record(
        self, req: RouteRequest, chosen: BackendLike, scored: list[_Scored], reach: Reach
    ) -> None:
        """Keep the decision as it stands; `recent` formats it only when someone asks."""
        media = tuple([tier.medium for tier, _ in reach]) if reach else ()
        self._recent.append((time.time(), req.model, req.prompt_tokens, chosen.name, scored, media))

    @property
    def recent(self) -> list[dict[str, Any]]:
        """The last decisions with their scores, for /debug/routing: per backend the
        cost (`cost_s`) and its TTFT estimate (`ttft_s`), the prompt tokens it need not
        prefill (`cached`), and of those how many are on its GPU and, per tier, how many
        more it reaches there (`tiers`)."""
        return [
            {
                "at": at,
                "model": model,
                "prompt_tokens": tokens,
                "chosen": chosen,
                "scores": {
                    b.name: _described(cost, ttft, covered, gpu, _per_tier(media, reached, gpu))
                    for cost, covered, b, gpu, reached, ttft, _ in scored
                },
            }
            for at, model, tokens, chosen, scored, media in self._recent
        ]


def _reason(covered: int, cached: int) -> Reason:
    if covered > cached:
        return Reason.KV_TIER
    return Reason.KV_HIT if cached else Reason.KV_COLD


def _per_tier(media: tuple[str, ...], reached: tuple[int, ...], gpu: int) -> dict[str, int]:
    """The tokens beyond the GPU's each tier adds (`reached` is cumulative)."""
    before, added = gpu, {}
    for medium, tokens in zip(media, reached, strict=True):
        added[medium], before = tokens - before, tokens
    return added


def _described(
    cost: float, ttft: float, covered: int, gpu: int, tiers: dict[str, int]
) -> dict[str, Any]:
    found: dict[str, Any] = {"cost_s": round(cost, 6), "ttft_s": round(ttft, 6), "cached": covered}
    if tiers:
        found["gpu"] = gpu
        found["tiers"] = tiers
    return found
