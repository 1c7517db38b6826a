"""One backend's block keys on one medium, least recently used first, within their bounds.

The prefix index (hashing/prefix_index.py) keeps one `Holdings` per backend and answers
its lookups from them; this is their upkeep and eviction, apart from the lookup:

- *confirmed* keys, from the backend's KV events, each with the backend's own (engine)
  hash so that a BlockRemoved finds it: at most `capacity`, the least recently stored
  leaving first;
- *speculative* keys, from the router's own decisions, each with its expiry
  (time.monotonic): at most `capacity`, or `trusted` when the backend's answers proved it
  keeps fewer (hashing/cache_trust.py), the least recently used leaving first.

A key may be in both; the backend holds it while either has it (`key in holdings`). Each
step that lets keys go returns the keys that left one of the two, and the index releases,
from its reverse map, those that left both. Not thread-safe: one event loop owns it.

The containers are made once, with the `Holdings`, and only ever changed in place: an
OrderedDict is always tracked by the cyclic garbage collector, and one of a million keys
costs a pass ~10-30 ms to traverse, on the event loop. Made before `kvroute serve`
freezes what start-up built (router/control/serve.py, `PrefixIndex.reserve`), they stay
out of every pass however large they grow.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["Holdings"]


class Holdings:
    __slots__ = ("by_engine", "capacity", "confirmed", "speculative", "trusted")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        #: how many speculative keys are kept (a learned bound below `capacity`)
        self.trusted: int | None = None
        #: key -> engine hash, least recently stored first
        self.confirmed: OrderedDict[int, int] = OrderedDict()
        #: engine hash -> key, for BlockRemoved and token-less stores
        self.by_engine: dict[int, int] = {}
        #: key -> expiry, least recently used first
        self.speculative: OrderedDict[int, float] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self.confirmed or key in self.speculative

    def confirm(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Store (key, engine hash) pairs as the most recently stored (see `trimmed`)."""
        confirmed, by_engine = self.confirmed, self.by_engine
        for key, engine in pairs:
            confirmed[key] = engine
            confirmed.move_to_end(key)
            by_engine[engine] = key

    def speculate(self, keys: Sequence[int], expires_at: float) -> None:
        """The router just sent `keys` there: the most recently used, until `expires_at`."""
        spec = self.speculative
        for key in keys:
            spec[key] = expires_at
            spec.move_to_end(key)

    def touch(self, keys: Sequence[int], expires_at: float) -> None:
        """The speculative ones of `keys` were just found there: the most recently used
        (the head of the chain last, so it leaves last), with a new expiry."""
        spec = self.speculative
        for key in reversed(keys):
            if key in spec:
                spec[key] = expires_at
                spec.move_to_end(key)

    def trimmed(self) -> list[int]:
        """Let the least recently used keys beyond the bounds go; the keys that left."""
        gone: list[int] = []
        confirmed, spec = self.confirmed, self.speculative
        for _ in range(len(confirmed) - self.capacity):
            key, engine = confirmed.popitem(last=False)
            self.by_engine.pop(engine, None)
            gone.append(key)
        kept = self.capacity if self.trusted is None else min(self.capacity, self.trusted)
        for _ in range(len(spec) - kept):
            gone.append(spec.popitem(last=False)[0])
        return gone

    def removed(self, engine_hashes: Sequence[int]) -> list[int]:
        """A BlockRemoved: the blocks go, speculative entries included (the backend's word
        is final); the keys that left."""
        gone = []
        for engine in engine_hashes:
            key = self.by_engine.pop(engine, None)
            if key is None:
                continue
            confirmed = self.confirmed.pop(key, None) is not None
            if self.speculative.pop(key, None) is not None or confirmed:
                gone.append(key)
        return gone

    def cleared(self) -> Iterable[int]:
        """Every confirmed key goes; those that left."""
        gone = list(self.confirmed)
        self.confirmed.clear()
        self.by_engine.clear()
        return gone

    def dropped(self, keys: Iterable[int], confirmed: bool) -> list[int]:
        """The backend was found not to hold `keys`: their speculative entries go, and with
        `confirmed` their confirmed ones too; the keys that left."""
        gone = []
        for key in keys:
            left = self.speculative.pop(key, None) is not None
            if confirmed and (engine := self.confirmed.pop(key, None)) is not None:
                self.by_engine.pop(engine, None)
                left = True
            if left:
                gone.append(key)
        return gone

    def expired(self, now: float) -> list[int]:
        """Speculative keys whose expiry passed go (oldest first); those that left."""
        gone = []
        spec = self.speculative
        while spec:
            key, expires_at = next(iter(spec.items()))
            if expires_at > now:
                break
            del spec[key]
            gone.append(key)
        return gone

    def restored(self, pairs: Sequence[Sequence[int]]) -> Iterable[int]:
        """Replace the confirmed keys with (key, engine hash) `pairs`; the keys held before."""
        old = self.cleared()
        self.confirm((key, engine) for key, engine in pairs)
        return old

    def all_keys(self) -> set[int]:
        """Every key held, of either kind."""
        return {*self.confirmed, *self.speculative}
