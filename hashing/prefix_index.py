"""Which backend holds which prefix blocks, and how long a prefix each one has cached.

Two sources feed it, per backend:
- *confirmed* keys, from the backend's own KV events: BlockStored adds (the event's token
  ids re-hashed into router keys with `hashing.blocks.chain`, so vLLM's hashes only serve
  to find the parent and to apply BlockRemoved), BlockRemoved and AllBlocksCleared drop;
- *speculative* keys, from the router's own decisions (`learn`): inserted on route with a
  TTL, so a burst of a new prefix stays together before any event confirms it, and the
  only source for a backend that publishes no events (approximate mode).

Three parts, one job each: each backend's keys in LRU order within their bounds
(`Holdings`, hashing/holdings.py), the reverse map from each key to the backends holding it
(`HolderMap`, hashing/holder_map.py), and the lookups over both (`PrefixLookup`,
hashing/prefix_lookup.py: `longest_prefix`, `holders`). `PrefixIndex` applies each
source's changes to the first two and keeps them in step: a key stays in the reverse map
while one of its backend's holdings has it.

Memory is bounded per backend by `capacity` keys (LRU over confirmed keys, and as many
speculative ones, or as many as the backend's answers showed it keeps, `trust`; the
backend's `num_gpu_blocks` is the natural value), and the reverse map by the sum of those:
one entry per key held anywhere. Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hashing.blocks import chain
from hashing.holdings import Holdings
from hashing.prefix_lookup import PrefixLookup

__all__ = ["PrefixIndex"]


class PrefixIndex(PrefixLookup):
    def __init__(self, capacity: int = 1_000_000) -> None:
        super().__init__()
        self._capacity = capacity
        #: BlockStored events skipped because their parent block was unknown
        self.orphans = 0

    def _of(self, backend: str) -> Holdings:
        h = self._backends.get(backend)
        if h is None:
            h = self._backends[backend] = Holdings(self._capacity)
        return h

    def reserve(self, backend: str) -> None:
        """Make `backend`'s holdings now, empty if new: made as the fleet is known at
        start-up, they are in what `kvroute serve` then freezes out of the garbage
        collector's passes (hashing/holdings.py)."""
        self._of(backend)

    def set_capacity(self, backend: str, capacity: int) -> None:
        h = self._of(backend)
        h.capacity = capacity
        self._left(backend, h, h.trimmed())

    def trust(self, backend: str, blocks: int | None) -> None:
        """Keep at most `blocks` speculative keys of `backend` (None: `capacity`), the
        least recently used leaving first: what it proved it keeps (hashing/cache_trust.py)."""
        h = self._of(backend)
        h.trusted = blocks
        self._typical()
        self._left(backend, h, h.trimmed())

    def stored(
        self,
        backend: str,
        parent_engine: int | None,
        engine_hashes: Sequence[int],
        token_ids: Sequence[int],
        block_size: int,
        root: int,
        also: PrefixIndex | None = None,
    ) -> bool:
        """Apply a BlockStored; False (and nothing stored) when its parent is unknown here
        and in `also` (another medium's index: an offload tier's chain can continue from a
        block only the GPU holds)."""
        h = self._of(backend)
        if parent_engine is None:
            parent = root
        else:
            found = h.by_engine.get(parent_engine)
            if found is None and also is not None:
                found = also.key_of(backend, parent_engine)
            if found is None:
                self.orphans += 1
                return False
            parent = found
        self.placed(backend, zip(chain(parent, token_ids, block_size), engine_hashes, strict=False))
        return True

    def placed(self, backend: str, pairs: Iterable[tuple[int, int]]) -> None:
        """Store known (key, engine hash) pairs: a token-less BlockStored, whose keys come
        from another medium's index (`key_of`)."""
        h = self._of(backend)
        pairs = list(pairs)
        self._holders.hold([key for key, _ in pairs], backend)
        h.confirm(pairs)
        self._left(backend, h, h.trimmed())

    def removed(self, backend: str, engine_hashes: Sequence[int]) -> None:
        """Apply a BlockRemoved. The backend's word is final: a speculative entry for the
        same block (the router sent it there earlier) goes too, or the router would keep
        crediting a block the backend has just said it evicted until its TTL ran out."""
        h = self._of(backend)
        self._left(backend, h, h.removed(engine_hashes))

    def cleared(self, backend: str) -> None:
        """AllBlocksCleared, a restart, or an unrecoverable event gap."""
        h = self._of(backend)
        self._left(backend, h, h.cleared())

    def forget(self, backend: str) -> None:
        """The backend left the fleet."""
        h = self._backends.pop(backend, None)
        if h is not None:
            for key in h.all_keys():
                self._holders.release(key, backend)
            self._typical()

    def learn(self, backend: str, keys: Sequence[int], expires_at: float) -> None:
        """Record that the router just sent these blocks to `backend` (speculative)."""
        h = self._of(backend)
        self._holders.hold(keys, backend)
        h.speculate(keys, expires_at)
        self._left(backend, h, h.trimmed())

    def dropped(self, backend: str, keys: Iterable[int], confirmed: bool = False) -> None:
        """`backend` was found not to hold `keys`: its speculative entries for them go,
        and with `confirmed` its confirmed ones too (its KV events are not keeping up)."""
        h = self._backends.get(backend)
        if h is not None:
            self._left(backend, h, h.dropped(keys, confirmed))

    def touched(self, backend: str, keys: Sequence[int], expires_at: float) -> None:
        """`backend` was just found holding `keys`: the speculative ones among them become
        its most recently used, with a new TTL (`Holdings.touch`)."""
        h = self._backends.get(backend)
        if h is not None:
            h.touch(keys, expires_at)

    def expire(self, now: float) -> None:
        """Drop speculative keys whose TTL passed (oldest first; called beside the path)."""
        for backend, h in self._backends.items():
            self._left(backend, h, h.expired(now))

    def restore(self, backend: str, pairs: Sequence[Sequence[int]]) -> None:
        """Replace `backend`'s confirmed keys with a `snapshot` (a worker joining late)."""
        h = self._of(backend)
        self._left(backend, h, h.restored(pairs))
        self._holders.hold(h.confirmed, backend)
        self._left(backend, h, h.trimmed())

    def _left(self, backend: str, h: Holdings, keys: Iterable[int]) -> None:
        """`keys` just left one of `backend`'s two holdings: released where they left both."""
        release = self._holders.release
        for key in keys:
            if key not in h:
                release(key, backend)
