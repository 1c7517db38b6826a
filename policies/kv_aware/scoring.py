"""Which candidates a KV_AWARE pick scores: those that can matter, each at its cost.

Only the candidates that can matter are scored (`sample` > 0, the default): the backends
holding the prompt's longest prefixes, which the index names without visiting the others
(at most 8 on the GPU and 8 per local offload tier; `PrefixIndex.holders`; a shared tier
reaches every backend, drawn ones included), plus `sample` others drawn uniformly from the
candidates ("power of k choices"; each is scored like the holders, so the least loaded of
them is the cold choice, and one that holds a shorter prefix gets its credit). The draws
are seeded by the first block no backend holds, so every worker and replica scores the same
backends for the same prompt and still places a new prefix alike, while different prompts
spread over the whole fleet. A fleet no larger than the holders plus `sample`, or than
`WHOLE` (16) candidates, is scored whole: at ~1.6 µs a candidate that costs at most
~25 µs more than the draws (bench/micro/test_bench_routing.py), and 3 draws of 4 left
the least loaded backend out of one cold pick in four, a new prompt then queueing
behind another's prefill. The pick equals the exhaustive one whenever it goes to a
holder; a cold prompt goes to the least loaded of its draws instead of the fleet's least
loaded. If every scored backend is at a cap (cost.py), the draws are made again among
those under it.
`sample: 0` scores every candidate.

Cost: O((holders + sample) * log blocks) for the lookups, whatever the fleet size
(O(candidates * log blocks) with `sample: 0`, and one O(candidates) filter when every
scored backend is at the cap).
"""

from __future__ import annotations

import random

from hashing.tiered_index import Reach, TieredIndex
from policies.base import BackendLike, FleetView, RouteRequest
from policies.kv_aware.cost import CostModel, Scored
from policies.kv_aware.params import KvAwareParams

__all__ = ["WHOLE", "Scoring"]

#: a fleet of at most this many candidates is scored whole
WHOLE = 16
#: at most this many holders of the longest prefixes are scored (the rest are drawn)
_HOLDERS = 8
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX = 0xBF58476D1CE4E5B9


class Scoring:
    def __init__(
        self, params: KvAwareParams, cost: CostModel, index: TieredIndex, rng: random.Random
    ) -> None:
        self.params = params
        self._cost = cost
        self._index = index
        self._gpu = index.gpu
        self._rng = rng
        #: the members by name, for the holders the index names (rebuilt when they change)
        self._members: tuple[BackendLike, ...] = ()
        self._named: dict[str, BackendLike] = {}

    def scored(self, req: RouteRequest, fleet: FleetView, reach: Reach) -> list[Scored]:
        """The estimates of the candidates under the cap that can matter (see above)."""
        sample = self.params.sample
        if sample:
            held = self._gpu.holders(req.blocks, _HOLDERS)
            if reach:
                held = self._with_tier_holders(req, held, reach)
            if len(fleet.candidates) > max(len(held) + sample, WHOLE):
                return self._pruned(req, fleet, held, reach)
        cost = self._cost
        return [cost.score(req, b, reach) for b in cost.under_cap(fleet.candidates)]

    def candidate(self, fleet: FleetView, name: str) -> BackendLike | None:
        """The candidate called `name`, if it is one and under the caps."""
        backend = self._by_name(fleet.members).get(name)
        if backend is None or name not in fleet.candidate_names or not self._cost.fits(backend):
            return None
        return backend

    def rescore(
        self, req: RouteRequest, scored: list[Scored], backend: BackendLike, reach: Reach
    ) -> None:
        """Score `backend` again in `scored` (the index changed), or add it if it was not
        among them (pruned)."""
        rescored = self._cost.score(req, backend, reach)
        for i, s in enumerate(scored):
            if s[2].name == backend.name:
                scored[i] = rescored
                return
        scored.append(rescored)

    def _with_tier_holders(
        self, req: RouteRequest, held: list[tuple[str, int]], reach: Reach
    ) -> list[tuple[str, int]]:
        """`held` (GPU holders and their blocks) and the holders on the local tiers of
        `reach`, with the blocks their GPU holds."""
        known = {name for name, _ in held}
        more = self._index.tier_holders(req.blocks, _HOLDERS, reach) - known
        return held + [(name, self._gpu.longest_prefix(req.blocks, name)) for name in more]

    def _pruned(
        self, req: RouteRequest, fleet: FleetView, held: list[tuple[str, int]], reach: Reach
    ) -> list[Scored]:
        """The holders that are candidates under the cap, and `sample` draws beside them."""
        named, names = self._by_name(fleet.members), fleet.candidate_names
        cost = self._cost
        scored = []
        for name, blocks in held:
            backend = named.get(name)
            if backend is not None and name in names and cost.fits(backend):
                scored.append(cost.estimate(req, backend, blocks, reach))
        deepest = max((blocks for _, blocks in held), default=0)
        seed = req.blocks[deepest] if deepest < len(req.blocks) else self._rng.getrandbits(64)
        taken = {s[2].name for s in scored}
        drawn = self._draws(req, fleet.candidates, seed, taken, reach)
        if not scored and not drawn:  # every one scored is at the cap: draw among the others
            pool = tuple(cost.under_cap(fleet.candidates))
            drawn = self._draws(req, pool, seed, taken, reach)
        return scored + drawn

    def _draws(
        self,
        req: RouteRequest,
        pool: tuple[BackendLike, ...],
        seed: int,
        taken: set[str],
        reach: Reach,
    ) -> list[Scored]:
        """Up to `sample` backends of `pool` under the cap and not `taken`, drawn by `seed`
        (at most twice as many draws, so a pool mostly taken or full costs no more)."""
        want, n = self.params.sample, len(pool)
        cost = self._cost
        drawn: list[Scored] = []
        for j in range(2 * want):
            if len(drawn) == want or not n:
                break
            backend = pool[(((seed + j * _GOLDEN) * _MIX) & _MASK) * n >> 64]
            if backend.name not in taken and cost.fits(backend):
                taken.add(backend.name)
                drawn.append(cost.score(req, backend, reach))
        return drawn

    def _by_name(self, members: tuple[BackendLike, ...]) -> dict[str, BackendLike]:
        if members is not self._members:
            self._members, self._named = members, {b.name: b for b in members}
        return self._named
