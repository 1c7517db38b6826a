"""The prefix index's lookups: how long a prefix of a prompt's blocks each backend holds.

`PrefixIndex` (hashing/prefix_index.py) keeps every backend's keys, confirmed and
speculative, in one `BlockTable` (hashing/_block_table.c: flat arrays, 50-70 bytes a (key,
backend) pair); this is their read side, which runs per candidate of every pick, each
lookup one call into the table.

`longest_prefix(keys, backend)` is a binary search over the request's key chain, assuming
holdership is prefix-closed (a backend that holds block i holds blocks < i): vLLM evicts a
chain from its tail, since a request frees its blocks last-first. That makes a lookup
O(log blocks) per candidate instead of a walk over every block.

`holders(keys, limit)` answers the other way round, without visiting every backend, from
each key's holder count. Prefix-closed holdership makes the number of holders of keys[i]
non-increasing in i, so a binary search finds the shallowest block held by at most
`limit` backends; those are the ones holding the longest prefixes, and each one's length
is one more binary search: O((1 + holders) * log blocks), whatever the fleet size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hashing._block_table import BlockTable
from hashing.rendezvous import name_hash

__all__ = ["CONFIRMED", "Held", "Member", "PrefixLookup"]

#: the table's kind for keys from the backend's KV events (the router's picks are 1)
CONFIRMED = 0


@dataclass(slots=True)
class Member:
    """One backend's place in the table and its bounds."""

    id: int
    #: confirmed keys kept (LRU), and speculative ones at most
    capacity: int
    #: how many speculative keys are kept: a learned bound below `capacity`
    trusted: int | None = None


@dataclass(frozen=True, slots=True)
class Held:
    """One backend's keys (`key in held`), or every backend's with `member` None: what a
    search over several media unites (hashing/tiered_index.py)."""

    table: BlockTable
    member: int | None

    def __contains__(self, key: int) -> bool:
        if self.member is None:
            return self.table.anywhere(key)
        return self.table.has(self.member, key)


class PrefixLookup:
    """The lookups over `_table` and `_members` (each backend's place in it), which a
    subclass keeps (`PrefixIndex`)."""

    def __init__(self, capacity: int) -> None:
        self._table = BlockTable()
        #: a new member's bound
        self._capacity = capacity
        self._members: dict[str, Member] = {}
        #: the names `holders` answers with, by member id
        self._names: dict[int, str] = {}
        #: the median of the learned bounds (`Member.trusted`), for backends with none
        self._typical_trust: int | None = None

    def _of(self, backend: str) -> Member:
        """`backend`'s place in the table, given now if it has none (the table gives the
        id, by the name's hash: the same in every process sharing it)."""
        m = self._members.get(backend)
        if m is None:
            member = self._table.member(name_hash(backend) or 1)
            self._names[member] = backend
            m = self._members[backend] = Member(member, self._capacity)
        return m

    def join(self, backends: Iterable[str]) -> None:
        """Give each of `backends` (the fleet's) its place now: a shared table's holders
        are named only by the processes that know their ids."""
        for backend in backends:
            self._of(backend)

    def _member(self, backend: str) -> Member | None:
        """`backend`'s place for a read: None if it has none here, but in a shared table
        always (another process may have written its keys)."""
        m = self._members.get(backend)
        return self._of(backend) if m is None and self._table.shared else m

    def key_of(self, backend: str, engine: int) -> int | None:
        """The router key of the block `backend` reported as `engine`, if it holds it."""
        m = self._member(backend)
        return self._table.key_of(m.id, engine) if m is not None else None

    def expiry(self, backend: str, key: int) -> float | None:
        """When `backend`'s speculative entry for `key` expires (None: it has none)."""
        m = self._member(backend)
        return self._table.expiry(m.id, key) if m is not None else None

    def room(self, backend: str) -> float:
        """Blocks `backend` takes before its entries let others go, where answers proved
        how many a cache keeps (`PrefixIndex.trust`): its bound, or the fleet's typical
        one until its own is learned (as with the learned speeds: a fleet is mostly of
        one kind, and one backend's miss then teaches the others' placements), less the
        speculative keys it holds. Unbounded while no backend's bound is learned (the
        caches' size is unknown, or large enough that each engine's own LRU decides)."""
        m = self._member(backend)
        bound = None if m is None else m.trusted
        if bound is None:
            bound = self._typical_trust
        if m is None or bound is None:
            return math.inf
        return min(m.capacity, bound) - self._table.size(m.id)[1]

    def vacancy(self, backend: str) -> tuple[float, int]:
        """How empty `backend`'s cache is, larger the emptier: its `room` (where answers
        proved a bound), then the blocks it does not hold, as the negated count of the keys
        it holds (confirmed and speculative, a key in both counted twice: a rough measure,
        for ranking). O(1)."""
        m = self._member(backend)
        if m is None:
            return math.inf, 0
        return self.room(backend), -sum(self._table.size(m.id))

    def _typical(self) -> None:
        """Recompute the median learned bound (at each change of one: per answer that
        moves a capacity, not per pick)."""
        bounds = sorted(m.trusted for m in self._members.values() if m.trusted is not None)
        self._typical_trust = bounds[len(bounds) // 2] if bounds else None

    def longest_prefix(self, keys: Sequence[int], backend: str) -> int:
        """How many leading blocks of `keys` the backend holds (binary search, see above)."""
        m = self._member(backend)
        return self._table.longest(keys, m.id) if m is not None else 0

    def holders(self, keys: Sequence[int], limit: int) -> list[tuple[str, int]]:
        """(backend, blocks held) for the backends holding the longest prefixes of `keys`:
        every holder of keys[0] when they are at most `limit`, else those holding more
        blocks than the deepest level held by over `limit` (or the `limit` earliest holders
        of the longest prefix, when that many tie on it). Cost: O((1 + limit) * log
        blocks)."""
        names = self._names
        return [
            (names[member], blocks)
            for member, blocks in self._table.holders(keys, limit)
            if member in names  # a shared table's backend this process does not route to
        ]

    def share(self, path: str) -> None:
        """Keep the table in the file at `path`, which every process of the host maps
        (hashing/_block_table.c): called before anything is in it."""
        if self._members:
            raise RuntimeError("an index is shared before it holds anything")
        self._table = BlockTable(path)

    @property
    def shared(self) -> bool:
        return self._table.shared

    def hold(self) -> None:
        """Keep a shared table to this process until `let_go` (nested holds count)."""
        self._table.hold()

    def let_go(self) -> None:
        self._table.let_go()

    @property
    def cut_short(self) -> int:
        """Writes a shared table's file system had no room to finish (its `full`)."""
        return self._table.full

    def held(self, backend: str) -> Held | None:
        """`backend`'s keys, of either kind, for a search over several media."""
        m = self._member(backend)
        return Held(self._table, m.id) if m is not None else None

    def anywhere(self) -> Held:
        """Every key some backend holds: a shared tier's contents."""
        return Held(self._table, None)

    def snapshot(self, backend: str) -> list[tuple[int, int]]:
        """The confirmed (key, engine hash) pairs of `backend`, least recently stored first."""
        m = self._member(backend)
        return self._table.snapshot(m.id, CONFIRMED) if m is not None else []

    def size(self, backend: str) -> tuple[int, int]:
        """(confirmed, speculative) keys held for `backend`."""
        m = self._member(backend)
        return self._table.size(m.id) if m is not None else (0, 0)

    def holder_keys(self) -> int:
        """Keys held by at least one backend."""
        return len(self._table)

    @property
    def nbytes(self) -> int:
        """Bytes the table's arrays take."""
        return self._table.nbytes
