"""The prefix index's lookups: how long a prefix of a prompt's blocks each backend holds.

`PrefixIndex` (hashing/prefix_index.py) keeps each backend's `Holdings` (hashing/holdings.py)
and the reverse map (`HolderMap`, hashing/holder_map.py) in step with the KV events and
the router's decisions; this is their read side, which runs per candidate of every pick
and so reads the maps directly, with no call per key.

`longest_prefix(keys, backend)` is a binary search over the request's key chain, assuming
holdership is prefix-closed (a backend that holds block i holds blocks < i): vLLM evicts a
chain from its tail, since a request frees its blocks last-first. That makes a lookup
O(log blocks) per candidate instead of a walk over every block.

`holders(keys, limit)` answers the other way round, without visiting every backend, from
the reverse map. Prefix-closed holdership makes the number of holders of keys[i]
non-increasing in i, so a binary search finds the shallowest block held by at most
`limit` backends; those are the ones holding the longest prefixes, and each one's length
is one more binary search: O((1 + holders) * log blocks), whatever the fleet size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from itertools import islice

from hashing.holder_map import HolderMap, holder_count
from hashing.holdings import Holdings

__all__ = ["PrefixLookup"]

_NONE: dict[int, float] = {}


class PrefixLookup:
    """The lookups over `_backends` (each backend's `Holdings`) and `_holders` (the reverse
    map), which a subclass keeps (`PrefixIndex`): a base class rather than a member, so a
    lookup costs one call, as it did before the two were apart."""

    def __init__(self) -> None:
        self._backends: dict[str, Holdings] = {}
        self._holders = HolderMap()
        #: the median of the learned bounds (`Holdings.trusted`), for backends with none
        self._typical_trust: int | None = None

    def key_of(self, backend: str, engine: int) -> int | None:
        """The router key of the block `backend` reported as `engine`, if it holds it."""
        h = self._backends.get(backend)
        return h.by_engine.get(engine) if h is not None else None

    def expiry(self, backend: str, key: int) -> float | None:
        """When `backend`'s speculative entry for `key` expires (None: it has none)."""
        h = self._backends.get(backend)
        return h.speculative.get(key) if h is not None else None

    def room(self, backend: str) -> float:
        """Blocks `backend` takes before its entries let others go, where answers proved
        how many a cache keeps (`PrefixIndex.trust`): its bound, or the fleet's typical
        one until its own is learned (as with the learned speeds: a fleet is mostly of
        one kind, and one backend's miss then teaches the others' placements), less the
        speculative keys it holds. Unbounded while no backend's bound is learned (the
        caches' size is unknown, or large enough that each engine's own LRU decides)."""
        h = self._backends.get(backend)
        bound = None if h is None else h.trusted
        if bound is None:
            bound = self._typical_trust
        if h is None or bound is None:
            return math.inf
        return min(h.capacity, bound) - len(h.speculative)

    def vacancy(self, backend: str) -> tuple[float, int]:
        """How empty `backend`'s cache is, larger the emptier: its `room` (where answers
        proved a bound), then the blocks it does not hold, as the negated count of the keys
        it holds (confirmed and speculative, a key in both counted twice: a rough measure,
        for ranking). O(1)."""
        h = self._backends.get(backend)
        if h is None:
            return math.inf, 0
        return self.room(backend), -len(h.confirmed) - len(h.speculative)

    def _typical(self) -> None:
        """Recompute the median learned bound (at each change of one: per answer that
        moves a capacity, not per pick)."""
        bounds = sorted(h.trusted for h in self._backends.values() if h.trusted is not None)
        self._typical_trust = bounds[len(bounds) // 2] if bounds else None

    def longest_prefix(self, keys: Sequence[int], backend: str) -> int:
        """How many leading blocks of `keys` the backend holds (binary search, see above)."""
        h = self._backends.get(backend)
        if h is None or not keys or keys[0] not in h:
            return 0
        return _run(keys, h.confirmed, h.speculative, 1, len(keys))

    def holders(self, keys: Sequence[int], limit: int) -> list[tuple[str, int]]:
        """(backend, blocks held) for the backends holding the longest prefixes of `keys`:
        every holder of keys[0] when they are at most `limit`, else those holding more
        blocks than the deepest level held by over `limit` (or any `limit` of the holders of
        the longest prefix, when that many tie on it). Cost: O((1 + limit) * log blocks)."""
        held = self._holders
        deepest = self._deepest(keys)
        if not deepest:
            return []
        lo, hi = 0, deepest - 1  # the first i in [0, deepest) with at most `limit` holders
        if holder_count(held[keys[0]]) <= limit:
            hi = 0
        while lo < hi:
            mid = (lo + hi) // 2
            if holder_count(held[keys[mid]]) <= limit:
                hi = mid
            else:
                lo = mid + 1
        found = held[keys[lo]]
        if found.__class__ is str:
            names: Iterable[str] = (found,)
        else:
            names = found[:limit] if found.__class__ is tuple else islice(found, limit)
        return [(name, self._longer(keys, name, lo + 1, deepest)) for name in names]

    def _deepest(self, keys: Sequence[int]) -> int:
        """How many leading blocks of `keys` some backend holds (holdership is prefix-closed
        per backend, so it is over their union too)."""
        if not keys or keys[0] not in self._holders:
            return 0
        return _run(keys, self._holders, _NONE, 1, len(keys))

    def _longer(self, keys: Sequence[int], backend: str, lo: int, hi: int) -> int:
        """The blocks of `keys` that `backend` holds, known to be in [lo, hi] (most often
        hi: the longest prefix's holders are the likeliest to be asked about)."""
        h = self._backends[backend]
        if keys[hi - 1] in h:
            return hi
        return _run(keys, h.confirmed, h.speculative, lo, hi - 1)

    def holdings(self, backend: str) -> tuple[Mapping[int, object], ...]:
        """`backend`'s keys (confirmed, speculative), for a search over several media."""
        h = self._backends.get(backend)
        return (h.confirmed, h.speculative) if h is not None else ()

    def anywhere(self) -> Mapping[int, object]:
        """Every key some backend holds (the reverse map): a shared tier's contents."""
        return self._holders

    def snapshot(self, backend: str) -> list[tuple[int, int]]:
        """The confirmed (key, engine hash) pairs of `backend`, least recently stored first."""
        h = self._backends.get(backend)
        return list(h.confirmed.items()) if h else []

    def size(self, backend: str) -> tuple[int, int]:
        """(confirmed, speculative) keys held for `backend`."""
        h = self._backends.get(backend)
        return (len(h.confirmed), len(h.speculative)) if h else (0, 0)

    def holder_keys(self) -> int:
        """Keys held by at least one backend (the reverse map's size)."""
        return len(self._holders)


def _run(keys: Sequence[int], one: Mapping, other: Mapping, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with keys[n - 1] in `one` or `other` (keys[:lo] are), by
    binary search: the holdings are prefix-closed. Inlined lookups: it runs per candidate."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        key = keys[mid - 1]
        if key in one or key in other:
            lo = mid
        else:
            hi = mid - 1
    return lo
