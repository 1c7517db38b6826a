"""KV_AWARE: the backend where the whole request costs the fleet least, from its real cache.

A pick, unit by unit (each module of this folder says its part in full):

- scoring.py: the candidates that can matter, the backends holding the prompt's longest
  prefixes in the prefix index and `sample` others drawn beside them, each at
- cost.py: what the whole request costs the fleet there, in seconds: its time to first
  token (the queue ahead, the prefill of what the backend does not hold on its GPU or an
  offload tier, the first decode step), its decode, the harm it does the batch it joins,
  and a miss penalty per token to prefill; backends at a cap are skipped;
- ties.py: the minimum wins; candidates close to it tie, the longest prefix wins among
  them, a prompt cached nowhere goes to the emptiest of their caches, and equal holders
  go to the rendezvous winner of the prompt's first new block;
- upkeep.py: the decision feeds the index (the blocks it sends, speculatively) and, with
  several workers, their shared placements, which each pick reads first;
- decisions.py: the last decisions with their scores, for /debug/routing.

So a prefix stays where it is cached while staying costs less than moving it, and moves
once the holder's batch makes it dearer; an idle backend has no batch to harm and its
steps are the shortest, so new conversations go there even when all share a system
prompt the busy ones hold. With KV events on, every replica learns where the others put
a prefix from the backends themselves. A hot prefix spreads by itself: once its holders'
queues and batches cost more than a cold backend's full prefill plus the miss penalty,
the next request goes to another backend, which then holds the prefix too (the
speculative insert keeps a burst together there until its KV events confirm it), so the
holder set grows only as demand needs. When every candidate is at a cap, the least
loaded takes the request (ties at random).

Reads: RouteRequest.blocks/prompt_tokens/output_tokens, candidates' inflight,
queued_tokens, waiting, speed.
Cost: O((holders + sample) * log blocks) for the lookups, whatever the fleet size
(O(candidates * log blocks) with `sample: 0`); keys are cached by prefix in hashing/; one
shared-placement probe and one rendezvous rank per tied candidate. The whole-request cost
adds a few float operations per scored candidate to the lookups
(bench/micro/test_bench_routing.py).

Parameters (defaults; params.py): block_size (16, the backends' KV block size, which KV
events need; a config without KV events makes it 64 unless it sets it: router/config.py),
tokenizer ({kind: chatml4}, or {kind: hf, path: /models/llama} for vLLM; {kind: text}, keys
of the text itself, without KV events unless the config sets it), max_prefix_tokens
(32768), prefill_tokens_per_s (10000), decode_step_s (0.025), decode_s_per_request
(0.00015), output_tokens (256), waiting_s_per_request (0.05), miss_penalty (1.0), harm_weight
(0.5), eviction_penalty (1.0), tie_fraction (0.1), tie_seconds (0.005),
concurrency_threshold (null), max_queue_s (null), speculative_ttl_s (2.0, when the
backend publishes events), approximate_ttl_s (600, when it does not), index_capacity
(1_000_000 keys per backend and medium), sample (3; 0 scores every candidate; a fleet of
up to 16 is scored whole), tiers ({cpu: {load_s_per_token: 1.6e-6}, storage:
{load_s_per_token: 1.3e-5}}, sources at DEFAULT_TIERS; `shared: true` marks a store
every backend reads), seed.
YAML:
  routing: {strategy: KV_AWARE, block_size: 16, prefill_tokens_per_s: 10000, sample: 3}
"""

from __future__ import annotations

import copy
import random
import typing
from typing import Any

from hashing.chat_tokens import PromptBlocks, make_prompt_blocks
from hashing.tiered_index import Reach
from policies.base import BackendLike, FleetView, Pick, Placements, Policy, Reason, RouteRequest
from policies.kv_aware.cost import CostModel, Scored
from policies.kv_aware.decisions import Decisions
from policies.kv_aware.params import KvAwareParams
from policies.kv_aware.scoring import Scoring
from policies.kv_aware.ties import TieBreak
from policies.kv_aware.upkeep import IndexUpkeep
from policies.least_outstanding_requests import least_loaded
from policies.registry import register

__all__ = ["KvAwarePolicy"]


@register
class KvAwarePolicy(Policy[KvAwareParams]):
    """The pick's steps in order, each delegated to its unit (see the module)."""

    use_when = "in doubt (the default): shared prefixes, long prompts, uneven load"

    def __init__(self, params: KvAwareParams) -> None:
        super().__init__(params)
        self._upkeep = IndexUpkeep(params)
        #: the prefix index, which the router's telemetry also feeds
        self.index = self._upkeep.index
        #: backends that publish KV events; the others are indexed from our own decisions
        self.event_backends = self._upkeep.event_backends
        max_blocks = params.max_prefix_tokens // params.block_size
        tok = params.tokenizer
        self._blocks = make_prompt_blocks(params.block_size, max_blocks, tok.kind, tok.path)
        #: one generator for every random step, so a seed replays the same picks
        self._rng = random.Random(params.seed)
        self._decisions = Decisions()
        self._weigh(params)

    def _weigh(self, params: KvAwareParams) -> None:
        """The units that read the parameters a pool may set for itself."""
        self._cost = CostModel(params, self.index)
        self._scoring = Scoring(params, self._cost, self.index, self._rng)
        self._ties = TieBreak(params, self.index.gpu, self._rng)

    def tuned(self, params: KvAwareParams) -> KvAwarePolicy:
        """As `Policy.tuned`, with its own cost, scoring and ties, and its own placements
        (`share`) over the shared index."""
        twin = typing.cast(KvAwarePolicy, super().tuned(params))
        twin._upkeep = copy.copy(self._upkeep)
        twin._weigh(params)
        return twin

    @property
    def block_keys(self) -> PromptBlocks:
        return self._blocks

    def on_fleet_change(self, members: tuple[BackendLike, ...]) -> None:
        names = {m.name for m in members}
        self._upkeep.keep(names)
        self._ties.keep(names)

    def share(self, placements: Placements) -> None:
        self._upkeep.placements = placements

    def share_index(self, directory: str) -> None:
        self.index.share(directory)

    def pace(self, keys: int) -> None:
        self._upkeep.pace = keys

    @property
    def deferred(self) -> bool:
        return bool(self._upkeep.pending)

    def drain(self) -> bool:
        return self._upkeep.drain()

    def pick(self, req: RouteRequest, fleet: FleetView) -> Pick:
        if not fleet.candidates:
            return Pick(None, Reason.NO_CANDIDATE)
        with self.index.steady():  # another worker's pick lands before or after, whole
            return self._pick(req, fleet)

    def _pick(self, req: RouteRequest, fleet: FleetView) -> Pick:
        reach = self.index.reach()
        scored = self._scoring.scored(req, fleet, reach)
        if not scored:
            return Pick(least_loaded(fleet.candidates, self._rng), Reason.ALL_SATURATED)
        if self._upkeep.placements is not None:
            self._adopt_placement(req, fleet, scored, reach)
        cost, covered, backend, cached, *_ = self._ties.winner(req, scored)
        self._upkeep.learn(req, backend, cached)
        self._decisions.record(req, backend, scored, reach)
        return Pick(backend, _reason(covered, cached), covered, cost=cost)

    def retract(self, req: RouteRequest, pick: Pick) -> None:
        if pick.backend is not None:
            self._upkeep.retract(req, pick.backend.name)

    def _adopt_placement(
        self, req: RouteRequest, fleet: FleetView, scored: list[Scored], reach: Reach
    ) -> None:
        """Take another worker's recent placement of the blocks no candidate holds here:
        its backend holds them (speculatively) for this pick and the ones after it."""
        start = max(s[3] for s in scored) // self.params.block_size
        found = self._upkeep.placed_elsewhere(req.blocks, start)
        if found is None:
            return
        name, count, expires_at = found
        backend = self._scoring.candidate(fleet, name)
        if backend is None:
            return
        self._upkeep.adopt(name, req.blocks[start : start + count], expires_at)
        self._scoring.rescore(req, scored, backend, reach)

    @property
    def recent(self) -> list[dict[str, Any]]:
        """The last decisions with their scores, for /debug/routing (decisions.py)."""
        return self._decisions.recent()


def _reason(covered: int, cached: int) -> Reason:
    if covered > cached:
        return Reason.KV_TIER
    return Reason.KV_HIT if cached else Reason.KV_COLD
