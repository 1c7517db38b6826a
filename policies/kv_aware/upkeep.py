"""KV_AWARE's index upkeep: what keeps its prefix index in step with where prompts went.

The index (`index`, hashing/tiered_index.py: the GPU and each offload tier) has three feeds:

- the backends' KV events, applied beside the path by the router's telemetry
  (router/telemetry/kv_events.py, index_upkeep.py) for the backends that publish them,
  which it adds to `event_backends`;
- the answers' cached-token counts, which correct it and bound, per backend, how many of
  the router's placements it trusts (hashing/cache_trust.py, fed by
  router/telemetry/cache_feedback.py);
- the policy's own decisions, here (`learn`): the blocks a pick sends past the cached
  prefix are inserted speculatively, for `speculative_ttl_s` on a backend that publishes
  events (until they confirm them) or `approximate_ttl_s` on one that does not (its only
  source), so a burst of one new prefix stays together.

With several worker processes, each decision is also written to the router's shared
placements (`share`, router/fleet/placements.py) before the pick returns, and each pick
first reads there whether another worker just sent this prompt's uncached blocks
somewhere (`placed_elsewhere`, then `adopt`), the router holding a router-wide lock
around the pick and its load count: a burst of one new prefix that the kernel spread over
the workers stays on one backend, as it would in one process. Where the workers share one
index (`TieredIndex.share`, the router's default with several), a placement is there for
every worker at once and the pick holds the index, so neither the table nor the broadcast
carries it (`replicate`: only to the router's other replicas). A backend that publishes
events is forgotten when it leaves the fleet.

Cost: O(new blocks) per pick for the insert (a hit inserts only what it adds), and one
shared-placement probe per pick. Paced (`pace`, which the router sets), a pick inserts
only its first `pace` new keys, the ones a next request most likely shares, and keeps the
rest pending: the router inserts them a slice at a time between requests (`drain`), so a
new 100,000-token prompt's ~2,048 keys (~0.5-2.8 ms) do not hold the event loop in one
turn. Slices go in prefix order, so a lookup meanwhile sees a shorter prefix, never a
hole; a later pick that learns the same keys on the same backend takes the pending rest
over, and a backend that leaves drops its pending slices. At most `MAX_PENDING` prompts
wait: past that a pick inserts the oldest's slices itself.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from hashing.tiered_index import Tier, TieredIndex
from policies.base import BackendLike, Placements, RouteRequest
from policies.kv_aware.params import KvAwareParams

__all__ = ["MAX_PENDING", "IndexUpkeep"]

#: prompts whose keys may wait for `drain` at once: past it a pick inserts the oldest's
#: itself (a loop too busy to drain between requests does not let the backlog grow)
MAX_PENDING = 8


class IndexUpkeep:
    def __init__(self, params: KvAwareParams) -> None:
        self.params = params
        tiers = [Tier(m, t.load_s_per_token, t.shared) for m, t in params.tiers.items()]
        self.index = TieredIndex(params.index_capacity, tiers)
        #: backends that publish KV events; the others are indexed from our own decisions
        self.event_backends: set[str] = set()
        #: the other workers' recent placements (None: one process)
        self.placements: Placements | None = None
        #: new keys a pick inserts at once, the rest left to `drain` (None: all at once)
        self.pace: int | None = None
        #: (backend, first key still to insert) -> (keys, its index, expiry), oldest first
        self.pending: OrderedDict[tuple[str, int], tuple[Sequence[int], int, float]] = OrderedDict()
        #: the request learned last, and where each of its picks began inserting, by
        #: backend (`retract`)
        self._learned: tuple[RouteRequest | None, dict[str, int]] = (None, {})

    def keep(self, names: set[str]) -> None:
        """Forget the backends that publish events and are not in `names` (they left);
        the others have their places in the index."""
        self.index.join(names)
        for gone in self.event_backends - names:
            self.index.forget(gone)
        for held in [held for held in self.pending if held[0] not in names]:
            del self.pending[held]

    def learn(self, req: RouteRequest, backend: BackendLike, cached: int) -> None:
        """Speculative insert: the blocks we send are about to be cached there.

        Only the blocks past the cached prefix are inserted, so a hit costs O(new blocks).
        """
        p = self.params
        start = cached // p.block_size
        new = req.blocks[start:]
        if not new:
            return
        name = backend.name
        if self._learned[0] is not req:
            self._learned = (req, {})
        self._learned[1][name] = start
        ttl = p.speculative_ttl_s if name in self.event_backends else p.approximate_ttl_s
        expires_at = time.monotonic() + ttl
        if self.pace is None or len(new) <= self.pace:
            self.index.gpu.learn(name, new, expires_at)
        else:
            self.pending.pop((name, new[0]), None)
            self._insert(name, new, 0, expires_at)
            while len(self.pending) > MAX_PENDING:
                self.drain()
        if self.placements is None:
            return
        if self.index.shared:  # the other workers see the placement in the index
            self.placements.replicate(name, req.blocks, start, expires_at)
        else:
            self.placements.place(name, req.blocks, start, expires_at)

    def retract(self, req: RouteRequest, name: str) -> None:
        """Undo `learn`'s insert of `req` on `name` (a pick the router did not follow):
        the speculative keys, the pending rest, the shared placement. What a pick learned
        goes only in its own loop turn, before another request could rely on it."""
        learned, starts = self._learned
        start = starts.pop(name, None) if learned is req else None
        if start is None:
            return
        new = req.blocks[start:]
        self.index.gpu.dropped(name, new)
        if self.pace is not None and len(new) > self.pace:
            self.pending.pop((name, new[self.pace]), None)
        if self.placements is None:
            return
        if self.index.shared:  # as `learn` replicated it
            self.placements.recall(name, req.blocks, start)
        else:
            self.placements.withdraw(name, req.blocks, start)

    def drain(self) -> bool:
        """Insert the next slice of the oldest pending learn (`pace` keys); True while
        some remain. Slices whose expiry passed are dropped, as the index would drop them."""
        if not self.pending:
            return False
        held = next(iter(self.pending))
        keys, start, expires_at = self.pending.pop(held)
        if expires_at > time.monotonic():
            rest = self._insert(held[0], keys, start, expires_at)
            if rest is not None:
                self.pending.move_to_end(rest, last=False)  # the oldest finishes first
        return bool(self.pending)

    def _insert(
        self, name: str, keys: Sequence[int], start: int, expires_at: float
    ) -> tuple[str, int] | None:
        """Learn `pace` keys of `keys` from `start`; the rest, if any, pending (keyed by its
        first key, which a later pick of the same prefix there starts its new keys at)."""
        end = start + (self.pace or len(keys))
        self.index.gpu.learn(name, keys[start:end], expires_at)
        if end >= len(keys):
            return None
        rest = (name, keys[end])
        self.pending[rest] = (keys, end, expires_at)
        return rest

    def placed_elsewhere(self, keys: Sequence[int], start: int) -> tuple[str, int, float] | None:
        """(backend, blocks, expires_at): another worker's recent placement of `keys` from
        `keys[start]` on, if any (`Placements.held`)."""
        if self.placements is None or self.index.shared or start >= len(keys):
            return None
        return self.placements.held(keys, start)

    def adopt(self, backend: str, keys: Sequence[int], expires_at: float) -> None:
        """`backend` holds `keys` (speculatively) as another worker placed them there."""
        self.index.gpu.learn(backend, keys, expires_at)
