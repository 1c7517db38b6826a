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

`holders(keys, limit)` answers the other way round, without visiting every backend: a
reverse map from each key to the backends holding it (confirmed or speculative) is kept in
step with the per-backend holdings. Prefix-closed holdership makes the number of holders
of keys[i] non-increasing in i, so a binary search finds the shallowest block held by at
most `limit` backends; those are the ones holding the longest prefixes, and each one's
length is one more binary search: O((1 + holders) * log blocks), whatever the fleet size.

Memory is bounded per backend by `capacity` keys (LRU over confirmed keys, and as many
speculative ones, or as many as the backend's answers showed it keeps, `trust`; the
backend's `num_gpu_blocks` is the natural value), and the reverse
map by the sum of those: one entry per key held anywhere, whose value is the holder's name
while there is one, a tuple of names while there are a few and a set once there are more.
Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice

from hashing.blocks import chain

__all__ = ["PrefixIndex"]


@dataclass
class _Holdings:
    capacity: int
    #: how many speculative keys are kept (a learned bound below `capacity`; see `trust`)
    trusted: int | None = None
    confirmed: OrderedDict[int, int] = field(default_factory=OrderedDict)
    by_engine: dict[int, int] = field(default_factory=dict)
    speculative: OrderedDict[int, float] = field(default_factory=OrderedDict)

    def __contains__(self, key: int) -> bool:
        return key in self.confirmed or key in self.speculative


#: the backends holding one key: its one holder's name, a tuple of a few, or a set of more
_Held = str | tuple[str, ...] | set[str]
_NONE: dict[int, float] = {}
#: holders kept in a tuple (a third of a small set's bytes; adding one copies it)
_FEW = 8


class PrefixIndex:
    def __init__(self, capacity: int = 1_000_000) -> None:
        self._capacity = capacity
        self._backends: dict[str, _Holdings] = {}
        self._holders: dict[int, _Held] = {}
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
        self._trim(backend, h)

    def trust(self, backend: str, blocks: int | None) -> None:
        """Keep at most `blocks` speculative keys of `backend` (None: `capacity`), the
        least recently used leaving first: what it proved it keeps (hashing/cache_trust.py)."""
        h = self._of(backend)
        h.trusted = blocks
        self._trim(backend, h)

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
        for key, engine in pairs:
            self._hold(key, backend)
            h.confirmed[key] = engine
            h.confirmed.move_to_end(key)
            h.by_engine[engine] = key
        self._trim(backend, h)

    def key_of(self, backend: str, engine: int) -> int | None:
        """The router key of the block `backend` reported as `engine`, if it holds it."""
        h = self._backends.get(backend)
        return h.by_engine.get(engine) if h is not None else None

    def removed(self, backend: str, engine_hashes: Sequence[int]) -> None:
        """Apply a BlockRemoved. The backend's word is final: a speculative entry for the
        same block (the router sent it there earlier) goes too, or the router would keep
        crediting a block the backend has just said it evicted until its TTL ran out."""
        h = self._of(backend)
        for engine in engine_hashes:
            key = h.by_engine.pop(engine, None)
            if key is None:
                continue
            confirmed = h.confirmed.pop(key, None) is not None
            if h.speculative.pop(key, None) is not None or confirmed:
                self._unheld(key, backend, h)

    def cleared(self, backend: str) -> None:
        """AllBlocksCleared, a restart, or an unrecoverable event gap."""
        h = self._of(backend)
        confirmed = h.confirmed
        h.confirmed = OrderedDict()
        h.by_engine.clear()
        for key in confirmed:
            self._unheld(key, backend, h)

    def forget(self, backend: str) -> None:
        """The backend left the fleet."""
        h = self._backends.pop(backend, None)
        if h is not None:
            for key in {*h.confirmed, *h.speculative}:
                self._release(key, backend)

    def learn(self, backend: str, keys: Sequence[int], expires_at: float) -> None:
        """Record that the router just sent these blocks to `backend` (speculative)."""
        h = self._of(backend)
        spec = h.speculative
        first_holder, to_end = self._holders.setdefault, spec.move_to_end
        for key in keys:  # a new prompt's keys are new: one probe each, no call
            if first_holder(key, backend) is not backend:
                self._hold(key, backend)
            spec[key] = expires_at
            to_end(key)
        self._trim(backend, h)

    def dropped(self, backend: str, keys: Iterable[int], confirmed: bool = False) -> None:
        """`backend` was found not to hold `keys`: its speculative entries for them go,
        and with `confirmed` its confirmed ones too (its KV events are not keeping up)."""
        h = self._backends.get(backend)
        if h is None:
            return
        for key in keys:
            gone = h.speculative.pop(key, None) is not None
            if confirmed and (engine := h.confirmed.pop(key, None)) is not None:
                h.by_engine.pop(engine, None)
                gone = True
            if gone:
                self._unheld(key, backend, h)

    def touched(self, backend: str, keys: Sequence[int], expires_at: float) -> None:
        """`backend` was just found holding `keys`: the speculative ones among them become
        its most recently used (the head of the chain last, so it leaves last), with a
        new TTL."""
        h = self._backends.get(backend)
        if h is None:
            return
        spec = h.speculative
        for key in reversed(keys):
            if key in spec:
                spec[key] = expires_at
                spec.move_to_end(key)

    def expiry(self, backend: str, key: int) -> float | None:
        """When `backend`'s speculative entry for `key` expires (None: it has none)."""
        h = self._backends.get(backend)
        return h.speculative.get(key) if h is not None else None

    def expire(self, now: float) -> None:
        """Drop speculative keys whose TTL passed (oldest first; called beside the path)."""
        for backend, h in self._backends.items():
            spec = h.speculative
            while spec:
                key, expires_at = next(iter(spec.items()))
                if expires_at > now:
                    break
                del spec[key]
                self._unheld(key, backend, h)

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
        if _count(held[keys[0]]) <= limit:
            hi = 0
        while lo < hi:
            mid = (lo + hi) // 2
            if _count(held[keys[mid]]) <= limit:
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

    def restore(self, backend: str, pairs: Sequence[Sequence[int]]) -> None:
        """Replace `backend`'s confirmed keys with a `snapshot` (a worker joining late)."""
        h = self._of(backend)
        old, h.confirmed = h.confirmed, OrderedDict((key, engine) for key, engine in pairs)
        h.by_engine = {engine: key for key, engine in h.confirmed.items()}
        for key in old:
            self._unheld(key, backend, h)
        for key in h.confirmed:
            self._hold(key, backend)
        self._trim(backend, h)

    def size(self, backend: str) -> tuple[int, int]:
        """(confirmed, speculative) keys held for `backend`."""
        h = self._backends.get(backend)
        return (len(h.confirmed), len(h.speculative)) if h else (0, 0)

    def holder_keys(self) -> int:
        """Keys held by at least one backend (the reverse map's size)."""
        return len(self._holders)

    def _trim(self, backend: str, h: _Holdings) -> None:
        for _ in range(len(h.confirmed) - h.capacity):
            key, engine = h.confirmed.popitem(last=False)
            h.by_engine.pop(engine, None)
            self._unheld(key, backend, h)
        kept = h.capacity if h.trusted is None else min(h.capacity, h.trusted)
        for _ in range(len(h.speculative) - kept):
            key, _expires_at = h.speculative.popitem(last=False)
            self._unheld(key, backend, h)

    def _hold(self, key: int, backend: str) -> None:
        """`backend` holds `key`, confirmed or speculatively (idempotent: one probe of the
        reverse map, none of the backend's holdings, as most keys stored are new)."""
        held = self._holders.setdefault(key, backend)
        if held is backend:
            return
        kind = held.__class__
        if kind is str:
            if held != backend:
                self._holders[key] = (held, backend)
        elif kind is tuple:
            if backend not in held:
                self._holders[key] = (*held, backend) if len(held) < _FEW else {*held, backend}
        else:
            held.add(backend)

    def _unheld(self, key: int, backend: str, h: _Holdings) -> None:
        """`key` just left one of `backend`'s two holdings: released if it left both."""
        if key not in h:
            self._release(key, backend)

    def _release(self, key: int, backend: str) -> None:
        held = self._holders.get(key)
        if held is None:
            return
        kind = held.__class__
        if kind is str:
            if held == backend:
                del self._holders[key]
            return
        if kind is set:
            held.discard(backend)
            if len(held) > _FEW:
                return
        elif backend not in held:
            return
        rest = tuple(name for name in held if name != backend)
        self._holders[key] = rest[0] if len(rest) == 1 else rest


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


def _count(held: _Held) -> int:
    return 1 if held.__class__ is str else len(held)
