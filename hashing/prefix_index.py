"""Which backend holds which prefix blocks, and how long a prefix each one has cached.

Two sources feed it, per backend:
- *confirmed* keys, from the backend's own KV events: BlockStored adds (the event's token
  ids re-hashed into router keys with `hashing.blocks.chain`, so vLLM's hashes only serve
  to find the parent and to apply BlockRemoved), BlockRemoved and AllBlocksCleared drop;
- *speculative* keys, from the router's own decisions (`learn`): inserted on route with a
  TTL, so a burst of a new prefix stays together before any event confirms it, and the
  only source for a backend that publishes no events (approximate mode).

`longest_prefix(keys, backend)` is a binary search over the request's key chain, assuming
holdership is prefix-closed (a backend that holds block i holds blocks < i): vLLM evicts a
chain from its tail, since a request frees its blocks last-first. That makes a lookup
O(log blocks) per candidate instead of a walk over every block.

Memory is bounded per backend by `capacity` keys (LRU over confirmed keys; the backend's
`num_gpu_blocks` is the natural value). Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from hashing.blocks import chain

__all__ = ["PrefixIndex"]


@dataclass
class _Holdings:
    capacity: int
    confirmed: OrderedDict[int, int] = field(default_factory=OrderedDict)
    by_engine: dict[int, int] = field(default_factory=dict)
    speculative: OrderedDict[int, float] = field(default_factory=OrderedDict)

    def __contains__(self, key: int) -> bool:
        return key in self.confirmed or key in self.speculative


class PrefixIndex:
    def __init__(self, capacity: int = 1_000_000) -> None:
        self._capacity = capacity
        self._backends: dict[str, _Holdings] = {}
        #: BlockStored events skipped because their parent block was unknown
        self.orphans = 0

    def _of(self, backend: str) -> _Holdings:
        h = self._backends.get(backend)
        if h is None:
            h = self._backends[backend] = _Holdings(self._capacity)
        return h

    def set_capacity(self, backend: str, capacity: int) -> None:
        h = self._of(backend)
        h.capacity = capacity
        self._trim(h)

    def stored(
        self,
        backend: str,
        parent_engine: int | None,
        engine_hashes: Sequence[int],
        token_ids: Sequence[int],
        block_size: int,
        root: int,
    ) -> bool:
        """Apply a BlockStored; False (and nothing stored) when its parent is unknown."""
        h = self._of(backend)
        if parent_engine is None:
            parent = root
        else:
            found = h.by_engine.get(parent_engine)
            if found is None:
                self.orphans += 1
                return False
            parent = found
        for engine, key in zip(engine_hashes, chain(parent, token_ids, block_size), strict=False):
            h.confirmed[key] = engine
            h.confirmed.move_to_end(key)
            h.by_engine[engine] = key
        self._trim(h)
        return True

    def removed(self, backend: str, engine_hashes: Sequence[int]) -> None:
        h = self._of(backend)
        for engine in engine_hashes:
            key = h.by_engine.pop(engine, None)
            if key is not None:
                h.confirmed.pop(key, None)

    def cleared(self, backend: str) -> None:
        """AllBlocksCleared, a restart, or an unrecoverable event gap."""
        h = self._of(backend)
        h.confirmed.clear()
        h.by_engine.clear()

    def forget(self, backend: str) -> None:
        """The backend left the fleet."""
        self._backends.pop(backend, None)

    def learn(self, backend: str, keys: Sequence[int], expires_at: float) -> None:
        """Record that the router just sent these blocks to `backend` (speculative)."""
        h = self._of(backend)
        spec = h.speculative
        for key in keys:
            spec[key] = expires_at
            spec.move_to_end(key)
        self._trim(h)

    def expire(self, now: float) -> None:
        """Drop speculative keys whose TTL passed (oldest first; called beside the path)."""
        for h in self._backends.values():
            spec = h.speculative
            while spec:
                key, expires_at = next(iter(spec.items()))
                if expires_at > now:
                    break
                del spec[key]

    def longest_prefix(self, keys: Sequence[int], backend: str) -> int:
        """How many leading blocks of `keys` the backend holds (binary search, see above)."""
        h = self._backends.get(backend)
        if h is None or not keys or keys[0] not in h:
            return 0
        lo, hi = 1, len(keys)  # keys[:lo] held; find the largest such lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in h:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def snapshot(self, backend: str) -> list[tuple[int, int]]:
        """The confirmed (key, engine hash) pairs of `backend`, least recently stored first."""
        h = self._backends.get(backend)
        return list(h.confirmed.items()) if h else []

    def restore(self, backend: str, pairs: Sequence[Sequence[int]]) -> None:
        """Replace `backend`'s confirmed keys with a `snapshot` (a worker joining late)."""
        h = self._of(backend)
        h.confirmed = OrderedDict((key, engine) for key, engine in pairs)
        h.by_engine = {engine: key for key, engine in h.confirmed.items()}
        self._trim(h)

    def size(self, backend: str) -> tuple[int, int]:
        """(confirmed, speculative) keys held for `backend`."""
        h = self._backends.get(backend)
        return (len(h.confirmed), len(h.speculative)) if h else (0, 0)

    def _trim(self, h: _Holdings) -> None:
        for _ in range(len(h.confirmed) - h.capacity):
            _, engine = h.confirmed.popitem(last=False)
            h.by_engine.pop(engine, None)
        for _ in range(len(h.speculative) - h.capacity):
            h.speculative.popitem(last=False)
