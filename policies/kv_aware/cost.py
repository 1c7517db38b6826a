"""KV_AWARE's cost: what the whole request costs the fleet on one backend, and its caps.

For each candidate b, in seconds, with p(b) its prefill rate and step(b, r) = a(b) +
c(b) x r its decode step with r requests in its batch:

    prefill(b) = uncached(b) / p(b) + loaded(b)
    ttft(b)    = queued_tokens(b) / p(b) + prefill(b) + step(b, inflight(b))
                 + waiting_s_per_request * waiting(b)
    decode(b)  = output_tokens * step(b, inflight(b) + 1)
    harm(b)    = inflight(b) * (harm_weight * prefill(b) + output_tokens * c(b) / 2)
    evict(b)   = max(0, new_blocks(b) - room(b)) * block_size / p(b)
    cost(b)    = ttft(b) + decode(b) + harm(b) + miss_penalty * uncached(b) / p(b)
                 + eviction_penalty * evict(b)

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
half its decode: they are halfway through theirs, on average). The prefill's delay
counts at `harm_weight` (0.5): at 1 the cost is the fleet's total latency, indifferent
between one request's first token coming a prefill later and the same seconds spread as
one longer step over every stream there, and a new prompt then often queued behind
another's prefill to spare a backend with one or two more streams (no-sharing on 4
simulated backends: TTFT P99 1.7x round robin's, for no gain in E2E P99). A first token
is what a user waits on; one longer step mid-stream is not felt the same. At 0.5 that
P99 is 1.1-1.2x round robin's, and the E2E tails of long-prefix and multi-turn do not move
(docs/performance.md).
The miss penalty is what it costs those that will queue behind its prefill (1.0: a
backend that would prefill a prompt another holds must save more than the prefill it
adds).

`evict` is what its new blocks push out of a cache that proved small: new_blocks(b) are
the prompt's blocks b's GPU does not hold, room(b) the blocks b takes before its entries
let others go, known once answers showed a cache keeps fewer blocks than the index
would (hashing/cache_trust.py: without KV events, or while they stall): b's own learned
bound, or the fleet's typical one until b has its own; unbounded before any. The blocks
pushed out are the least recently used there, another prompt's prefix, which a request
will pay to prefill again if it comes back (1.0: once). An engine that keeps two prompts
then takes a new document only where it has room for it, or where the others' costs
outweigh what it evicts; in a cache with room, or while none was seen to fall short,
the term is zero.

`concurrency_threshold` is a hard cap: backends at it are skipped; `max_queue_s` caps a
backend's estimated queue the same way (the work ahead of a new request, in seconds).
Either cap is KV_AWARE's saturation point, where a fleet with pools passes a request to
the next pool. The estimate adds a few float operations per scored candidate to its
index lookups.
"""

from __future__ import annotations

from hashing.tiered_index import Reach, TieredIndex
from policies.base import BackendLike, RouteRequest
from policies.kv_aware.params import KvAwareParams

__all__ = ["CostModel", "Scored"]

#: (estimated cost to the fleet, prompt tokens it need not prefill, backend, of them on
#: its GPU, tokens it reaches on its GPU and each tier of the request's `Reach`,
#: cumulative; estimated TTFT; the cost but its own decode)
Scored = tuple[float, int, BackendLike, int, tuple[int, ...], float, float]


def _attr(backend: BackendLike, name: str) -> float:
    return getattr(backend, name, 0) or 0


class CostModel:
    def __init__(self, params: KvAwareParams, index: TieredIndex) -> None:
        self.params = params
        self._index = index
        self._gpu = index.gpu

    def score(self, req: RouteRequest, backend: BackendLike, reach: Reach) -> Scored:
        """The estimate for `backend`, with the prefix its GPU holds looked up."""
        blocks = self._gpu.longest_prefix(req.blocks, backend.name)
        return self.estimate(req, backend, blocks, reach)

    def estimate(
        self, req: RouteRequest, backend: BackendLike, blocks: int, reach: Reach
    ) -> Scored:
        """The estimate for `backend`, holding the first `blocks` blocks of the prompt on
        its GPU and, beyond them, what it reaches on the tiers of `reach` at their cost
        (cheapest first: a block is loaded from the cheapest tier that has it)."""
        p = self.params
        prompt = req.prompt_tokens
        cached = covered = min(prompt, blocks * p.block_size)
        load, tiers = 0.0, ()
        if reach:
            reached = self._index.tier_blocks(req.blocks, backend.name, blocks, reach)
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
        harm = running * (p.harm_weight * prefill + output * per_request / 2)
        cost = ttft + decode + harm + p.miss_penalty * (prompt - covered) / rate
        evicted = -(-(prompt - cached) // p.block_size) - self._gpu.room(backend.name)
        if evicted > 0:
            cost += p.eviction_penalty * evicted * p.block_size / rate
        return cost, covered, backend, cached, tiers, ttft, cost - decode

    def under_cap(self, candidates: tuple[BackendLike, ...]) -> list[BackendLike]:
        p = self.params
        if p.concurrency_threshold is None and p.max_queue_s is None:
            return list(candidates)
        return [b for b in candidates if self.fits(b)]

    def fits(self, backend: BackendLike) -> bool:
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
        `estimate`'s TTFT but the request's own, which `estimate` keeps inline (it runs
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
