"""Which backend holds which prefix blocks, and how long a prefix each one has cached.

Two sources feed it, per backend:
- *confirmed* keys, from the backend's own KV events: BlockStored adds (the event's token
  ids re-hashed into router keys with `hashing.blocks.chain`, so vLLM's hashes only serve
  to find the parent and to apply BlockRemoved), BlockRemoved and AllBlocksCleared drop;
- *speculative* keys, from the router's own decisions (`learn`): inserted on route with a
  TTL, so a burst of a new prefix stays together before any event confirms it, and the
  only source for a backend that publishes no events (approximate mode).

The keys live in one `BlockTable` (hashing/_block_table.c): per backend and kind, a list
in least recently used order, and per key its holders, in flat arrays that the garbage
collector never walks. This module is the policy around it: each backend's place in the
table (`Member`), its bounds, and the event semantics; hashing/prefix_lookup.py the reads.

Memory is bounded per backend by `capacity` keys (LRU over confirmed keys, and as many
speculative ones, or as many as the backend's answers showed it keeps, `trust`; the
backend's `num_gpu_blocks` is the natural value). Not thread-safe: one event loop owns it.
With several processes the table can be one file they all map (`share`): each process
then keeps only its `Member`s, and a backend's id is the same in all of them (the table
gives it by the name's hash).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from hashing.blocks import chain
from hashing.prefix_lookup import CONFIRMED, Member, PrefixLookup

__all__ = ["PrefixIndex"]


class PrefixIndex(PrefixLookup):
    def __init__(self, capacity: int = 1_000_000) -> None:
        super().__init__(capacity)
        #: BlockStored events skipped because their parent block was unknown
        self.orphans = 0

    def _trim(self, m: Member) -> None:
        """Let each kind's least recently used keys beyond `m`'s bounds go."""
        kept = m.capacity if m.trusted is None else min(m.capacity, m.trusted)
        self._table.trim(m.id, m.capacity, kept)

    def set_capacity(self, backend: str, capacity: int) -> None:
        m = self._of(backend)
        m.capacity = capacity
        self._trim(m)

    def trust(self, backend: str, blocks: int | None) -> None:
        """Keep at most `blocks` speculative keys of `backend` (None: `capacity`), the
        least recently used leaving first: what it proved it keeps (hashing/cache_trust.py)."""
        m = self._of(backend)
        m.trusted = blocks
        self._typical()
        self._trim(m)

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
        if parent_engine is None:
            parent = root
        else:
            found = self.key_of(backend, parent_engine)
            if found is None and also is not None:
                found = also.key_of(backend, parent_engine)
            if found is None:
                self.orphans += 1
                return False
            parent = found
        keys = chain(parent, token_ids, block_size)
        m = self._of(backend)
        self._table.confirm(m.id, keys, engine_hashes)
        self._trim(m)
        return True

    def events(
        self,
        backend: str,
        events: list[Any],
        start: int,
        block_size: int,
        root: int,
        kinds: tuple[tuple[type, ...], tuple[type, ...]],
    ) -> tuple[int, int, int, int]:
        """Apply a KV event batch's stores and removals from `start` on, in one call, for
        as long as the table takes them whole (`BlockTable.events`: on this medium, hashes
        as ints, stores with token ids and no LoRA; `kinds`: the store and removal event
        types): (where it stopped, stores applied, removals applied, stores skipped)."""
        m = self._of(backend)
        stores, removals = kinds
        at, stored, removed, skipped, orphans = self._table.events(
            m.id, events, start, block_size, root, stores, removals
        )
        self.orphans += orphans
        if stored:
            self._trim(m)
        return at, stored, removed, skipped

    def placed(self, backend: str, pairs: Iterable[tuple[int, int]]) -> None:
        """Store known (key, engine hash) pairs: a token-less BlockStored, whose keys come
        from another medium's index (`key_of`)."""
        pairs = list(pairs)
        m = self._of(backend)
        self._table.confirm(m.id, [key for key, _ in pairs], [engine for _, engine in pairs])
        self._trim(m)

    def removed(self, backend: str, engine_hashes: Sequence[int]) -> None:
        """Apply a BlockRemoved. The backend's word is final: a speculative entry for the
        same block (the router sent it there earlier) goes too, or the router would keep
        crediting a block the backend has just said it evicted until its TTL ran out."""
        m = self._members.get(backend)
        if m is not None:
            self._table.removed(m.id, engine_hashes)

    def cleared(self, backend: str) -> None:
        """AllBlocksCleared, a restart, or an unrecoverable event gap."""
        m = self._members.get(backend)
        if m is not None:
            self._table.clear(m.id, CONFIRMED)

    def forget(self, backend: str) -> None:
        """The backend left the fleet: its keys go, and its place is free for another."""
        m = self._members.pop(backend, None)
        if m is not None:
            self._table.release(m.id)
            del self._names[m.id]
            self._typical()

    def learn(self, backend: str, keys: Sequence[int], expires_at: float) -> None:
        """Record that the router just sent these blocks to `backend` (speculative)."""
        m = self._of(backend)
        self._table.speculate(m.id, keys, expires_at)
        self._trim(m)

    def dropped(self, backend: str, keys: Sequence[int], confirmed: bool = False) -> None:
        """`backend` was found not to hold `keys`: its speculative entries for them go,
        and with `confirmed` its confirmed ones too (its KV events are not keeping up)."""
        m = self._members.get(backend)
        if m is not None:
            self._table.dropped(m.id, keys, confirmed)

    def touched(self, backend: str, keys: Sequence[int], expires_at: float) -> None:
        """`backend` was just found holding `keys`: the speculative ones among them become
        its most recently used (the chain's head last, so it leaves last), with a new TTL."""
        m = self._members.get(backend)
        if m is not None:
            self._table.touch(m.id, keys, expires_at)

    def expire(self, now: float) -> None:
        """Drop speculative keys whose TTL passed (oldest first; called beside the path)."""
        self._table.expire(now)

    def restore(self, backend: str, pairs: Sequence[Sequence[int]]) -> None:
        """Replace `backend`'s confirmed keys with a `snapshot` (a worker joining late).
        A shared table is the snapshot's source itself, and ahead of it: it stays."""
        m = self._of(backend)
        if self.shared:
            return
        self._table.clear(m.id, CONFIRMED)
        self._table.confirm(m.id, [p[0] for p in pairs], [p[1] for p in pairs])
        self._trim(m)
