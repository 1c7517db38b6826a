"""Where a router's workers just sent new prompt blocks: one view for KV_AWARE's learning.

With `serve --workers N` the kernel spreads connections over the workers, so the requests
of one new prefix arrive on several of them at once. Each worker's prefix index learns
from its own decisions; without this module each worker would place its share of the
burst as if no one held the prefix, and the burst would split over backends. Two paths,
one fast and lossy, one exact and a few milliseconds late:

- **The table** (`PlacementTable`): a set of (backend, block key) pairs in shared memory
  in the supervisor's run directory, written by `place` before the policy's pick returns
  (no await) and read by every worker's next pick (`held`), for two seconds at most (the
  broadcast's delay, with room to spare). It is direct-mapped: pair
  (b, k) lives in slot ``(k ^ hash(b)) mod SLOTS`` with its tag and expiry, and a newer
  pair overwrites an older one in its slot. `held` finds which backend holds a prompt's
  first uncached block (one probe per backend), then how many of the following blocks
  it holds by binary search, as the prefix index does (holdings are prefix-closed).
- **The lock** (`with table:`, router/dispatch/pick.py): a pick reads the table, decides,
  writes its placement and counts its request in the shared load table holding an
  `flock` on the table's file, so two workers' picks of one new prefix at the same
  instant go one after the other, the second finding the first's placement and load. It is held
  for one pick (tens to hundreds of microseconds), waited for at most 5 ms, yielding
  the core meanwhile (then the pick goes ahead without it: a holder descheduled on a
  busy machine must not stall this worker's streams longer), and a worker that dies
  holding it lets go with its file.
- **The broadcast**: the same placements, batched per loop turn, go to the collector's
  control socket and from there to every worker's index (router/telemetry/feed.py, topic
  `l`), exactly and for their whole TTL, however many the table has overwritten since.
  The batch also carries the answers' reported cached tokens (`answered`), which correct
  every worker's index and learned capacities alike (hashing/cache_trust.py).

Where the workers share one prefix index (hashing/_block_table.c, KV_AWARE), a placement is
in every worker's view the moment it is made: the policy writes neither the table nor the
broadcast (`replicate` keeps the batch for the router's other replicas, when there are
any), and an answer crosses as its `Lesson`, a few numbers, since the shared index is
corrected already.

Concurrency: each slot word is an aligned 8-byte store, so no value tears. Two workers
writing one slot at once leave one of the two pairs, possibly with the other's expiry;
an overwritten pair shortens a chain it was part of. The worst case is a wrong guess of
where a prefix is, which costs a cache miss, never an error.

Cost: `place` two word stores per new block, in two numpy stores;
`held` one probe per backend plus log2(blocks) probes for the holder, and a clock read;
the lock two system calls, and a wait while another worker picks.
2**20 slots of 16 bytes: 16 MB shared per router.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import msgspec
import numpy as np

from hashing.cache_trust import Answer, Lesson
from hashing.rendezvous import name_hash
from router.fleet.shared_load import lock_within, map_shared

__all__ = ["LEARNED", "Learned", "PlacementTable", "decode_learned", "encode_learned"]

SLOTS = 1 << 20  # a power of two: the slot is the low bits
_MASK = SLOTS - 1
#: how long a pick waits for another worker's: a scheduler slice, for a holder that was
#: descheduled mid-pick on a busy machine
_LOCK_WAIT_S = 0.005
#: how long the table vouches for a placement: until the broadcast has reached every
#: worker's index (milliseconds), with room for a busy machine. Longer, it would bring
#: back placements an index has since let go (hashing/cache_trust.py)
_TABLE_TTL_S = 2.0
#: the control-socket prefix of a broadcast batch (admin edits are JSON, hellos "hello")
LEARNED = b"L"


class Learned(msgspec.Struct, array_like=True):
    """A worker's placements of one loop turn, (backend, expires_at, keys) each, the
    answers whose reported cached tokens correct every worker's index, and, where the
    workers share one index, what the answers teach in their stead."""

    worker: int
    placed: list[tuple[str, float, list[int]]]
    answers: list[Answer] = []
    lessons: list[Lesson] = []


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Learned).decode


def encode_learned(batch: Learned) -> bytes:
    """A broadcast batch, for the control socket."""
    return LEARNED + _encode(batch)


def decode_learned(payload: bytes) -> Learned:
    """A broadcast batch (after `LEARNED`)."""
    return _decode(payload[len(LEARNED) :])


class PlacementTable:
    """One worker's mapping of the shared table, and its outgoing broadcast batch."""

    def __init__(
        self, path: str | Path, worker: int, send: Callable[[bytes], None], replicas: bool
    ) -> None:
        self._map = map_shared(path, SLOTS * 16)
        self._lock_fd = os.open(path, os.O_RDONLY)  # `lock`'s: flock is per open file
        self._locked = False  # `with table:` took the lock (it never nests: no await)
        self._tags = memoryview(self._map).cast("Q")  # even words; odd ones are expiries
        self._expiries = memoryview(self._map).cast("d")
        #: the same words as numpy arrays, for `place`'s bulk stores
        self._words_q = np.frombuffer(self._tags, dtype=np.uint64)
        self._words_d = np.frombuffer(self._expiries, dtype=np.float64)
        self._worker = worker
        self._send = send
        #: other router replicas read the placements (`cluster`, through the collector)
        self._replicas = replicas
        self._members: dict[str, int] = {}
        self._outbox: list[tuple[str, float, list[int]]] = []
        self._answers: list[Answer] = []
        self._lessons: list[Lesson] = []
        #: a flush is due at the end of this loop turn
        self._armed = False

    def lock(self) -> bool:
        """Take the pick lock if it comes within `_LOCK_WAIT_S` (an uncontended flock: two
        system calls). A worker holding it may be descheduled on a busy machine, and a
        blocking wait would stall this worker's every stream meanwhile: past the wait the
        pick goes ahead unlocked (False), risking only the split it guards against."""
        return lock_within(self._lock_fd, _LOCK_WAIT_S)

    def unlock(self) -> None:
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def __enter__(self) -> bool:
        self._locked = self.lock()
        return self._locked

    def __exit__(self, *exc: object) -> None:
        if self._locked:
            self.unlock()

    def known(self, names: Iterable[str]) -> None:
        """The fleet's backend names, the ones `held` looks for."""
        self._members = {n: name_hash(n) for n in names}

    def place(self, backend: str, keys: Sequence[int], start: int, expires_at: float) -> None:
        """Record that `backend` was just sent `keys[start:]`: in the table at once, and
        in the batch that goes to every worker at the end of this loop turn."""
        placed = list(keys[start:])
        if not placed:
            return
        member = self._members.get(backend) or name_hash(backend)
        until = min(expires_at, time.monotonic() + _TABLE_TTL_S)
        # in two numpy stores rather than a Python loop (~0.3 ms for a new 100k-token
        # prompt's 2,048 blocks): each element still one aligned 8-byte store, and every
        # expiry is written before the tags that make the pairs visible
        tags = np.array(placed, dtype=np.uint64) ^ np.uint64(member)
        slots = (tags & np.uint64(_MASK)).astype(np.intp) * 2
        self._words_d[slots + 1] = until
        self._words_q[slots] = tags
        self._flush_soon()
        self._outbox.append((backend, expires_at, placed))

    def replicate(self, backend: str, keys: Sequence[int], start: int, expires_at: float) -> None:
        """A placement the workers see in their shared index already: for the router's
        other replicas alone, in this turn's batch (nothing without replicas)."""
        if self._replicas and start < len(keys):
            self._flush_soon()
            self._outbox.append((backend, expires_at, list(keys[start:])))

    def dropped(self, backend: str, keys: Sequence[int]) -> None:
        """`backend` was found without `keys`: the table's pairs of them expire now, so no
        worker's next pick adopts them back."""
        member = self._members.get(backend) or name_hash(backend)
        tags, expiries = self._tags, self._expiries
        for key in keys:
            tag = key ^ member
            slot = (tag & _MASK) * 2
            if tags[slot] == tag:
                expiries[slot + 1] = 0.0

    def withdraw(self, backend: str, keys: Sequence[int], start: int) -> None:
        """`place`'s record of `keys[start:]` on `backend` in this loop turn goes: from the
        table, and from the batch not yet sent to the other workers."""
        placed = list(keys[start:])
        self.dropped(backend, placed)
        self._unsent(backend, placed)

    def recall(self, backend: str, keys: Sequence[int], start: int) -> None:
        """`replicate`'s record of `keys[start:]` on `backend` in this loop turn goes from
        the batch (the table never had it)."""
        if self._replicas:
            self._unsent(backend, list(keys[start:]))

    def _unsent(self, backend: str, placed: list[int]) -> None:
        """The last placement of `placed` on `backend` leaves the batch not yet sent."""
        for at in range(len(self._outbox) - 1, -1, -1):
            name, _, sent = self._outbox[at]
            if name == backend and sent == placed:
                del self._outbox[at]
                return

    def answered(self, answer: Answer) -> None:
        """An answer's cached tokens, for the other workers' indexes (hashing/cache_trust.py),
        in this loop turn's batch."""
        self._flush_soon()
        self._answers.append(answer)

    def taught(self, lesson: Lesson) -> None:
        """What an answer teaches, for the other workers (their shared index is corrected
        already), in this loop turn's batch."""
        self._flush_soon()
        self._lessons.append(lesson)

    def _flush_soon(self) -> None:
        if not self._armed:
            self._armed = True
            asyncio.get_running_loop().call_soon(self._flush)

    def held(self, keys: Sequence[int], start: int) -> tuple[str, int, float] | None:
        """The backend holding the most of the prompt's blocks from `keys[start]` on, by
        any worker's recent placement, the latest placed among equals: (backend, how
        many, expires_at), or None."""
        best: tuple[str, int, float] | None = None
        now = time.monotonic()
        for name, member in self._members.items():
            expires_at = self._expiry(keys[start], member, now)
            if expires_at is None:
                continue
            count = self._run(keys, start, member, now)
            if best is None or (count, expires_at) > best[1:]:
                best = (name, count, expires_at)
        return best

    def _run(self, keys: Sequence[int], start: int, member: int, now: float) -> int:
        """How many blocks from `start` on the member holds (keys[start] it does)."""
        lo, hi = 1, len(keys) - start
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._expiry(keys[start + mid - 1], member, now) is None:
                hi = mid - 1
            else:
                lo = mid
        return lo

    def _expiry(self, key: int, member: int, now: float) -> float | None:
        tag = key ^ member
        slot = (tag & _MASK) * 2
        if self._tags[slot] != tag:
            return None
        expires_at = self._expiries[slot + 1]
        return expires_at if expires_at > now else None

    def _flush(self) -> None:
        self._armed = False
        if not self._outbox and not self._answers and not self._lessons:
            return  # all withdrawn
        batch = Learned(self._worker, self._outbox, self._answers, self._lessons)
        self._outbox, self._answers, self._lessons = [], [], []
        self._send(encode_learned(batch))

    def close(self) -> None:
        del self._words_q, self._words_d  # their buffers' exports, before the releases
        self._tags.release()
        self._expiries.release()
        self._map.close()
        os.close(self._lock_fd)
