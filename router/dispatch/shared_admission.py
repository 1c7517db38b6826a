"""Router-wide admission counts shared by the worker processes (`serve --workers N`).

`max_concurrent_requests` and `max_concurrent_per_tenant` cap the router, not each
worker: the counts they are checked against live in one file in the supervisor's run
directory, mapped by every worker. Layout: rows of one int64 per worker, the way the
load table keeps its columns (router/fleet/shared_load.py):

    [row 0: requests admitted, w0..wN-1] [row 1..S: one tenant slot's requests, w0..wN-1]
    [row S+1..S+C: requests waiting in each priority class, w0..wN-1]
    [rows S+C+1..: the flow signals, router/dispatch/signals.py, w0..wN-1]

A worker writes only its own cells; a row's sum is the router's count. Tenants are an
open set, so a tenant is counted in slot ``1 + xxh3(tenant) mod S`` of a fixed table.
Collisions: two tenants hashed to one slot share its cap, so a collision can refuse a
tenant early, never admit one past its cap; with k tenants active at once, a tenant
shares its slot with probability about k / S (S = 16384). The slot's cells are never
freed or claimed: a count that drops to zero leaves nothing behind.

`take` adds one to this worker's cell first, then reads the row's sum; over the cap it
gives the one back. Far below the cap it decides without a lock: a worker runs one check
at a time with no await in it, and a store reaches the other cores within nanoseconds,
so a read can miss at most one count of each other worker (`workers - 1`). Closer to
the cap it holds an `flock` on the file while it reads and, if over, gives back: the
checks near the cap go one at a time, so of two requests racing for the last slot one
is admitted, never both, never neither. A holder descheduled mid-check is waited for
5 ms at most, then the check goes ahead unlocked: it may refuse needlessly, never admit
past the cap (the count is taken before the sum is read). A worker that dies holding
the lock lets go with its file; the supervisor zeroes a dead worker's column, so the
slots its requests held come back at once.

After the rows, the session affinity records every worker reads and writes
(router/dispatch/session.py): `SESSION_SLOTS` direct-mapped pairs of int64, (session
hash, backend-name hash << 32 | last use in whole seconds of the system-wide monotonic
clock). A collision overwrites: that session falls back to its rendezvous placement. A
pair read while another worker writes it may mix two records: the backend suggested is
still checked against the candidates, so at worst one request skips its affinity.

The waiting rows let the class order hold router-wide (router/dispatch/flow.py): a
worker hands a freed slot to its own best waiter only while no other worker has one of a
higher class waiting; otherwise it gives the slot back and that worker's poll takes it.
A worker writes its own class depths whenever its queue changes. The flow signals'
rows carry what the reserve and the fair shares need from every worker (signals.py).

Cost per request: a hash of the tenant, per row one store and one C-level sum of N
int64s, and two `flock` calls only near a cap; `give` one store.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import xxhash

from router.config import PRIORITIES
from router.dispatch.signals import ROWS, FlowCells
from router.fleet.shared_load import lock_within, map_shared

#: the row of requests admitted (per-tenant rows follow)
TOTAL = 0
TENANT_SLOTS = 1 << 14
#: the first of the rows of waiters by class
_WAITING = 1 + TENANT_SLOTS
#: session records, after the rows
SESSION_SLOTS = 1 << 16
_INT64 = 8
_LOCK_WAIT_S = 0.005


class AdmissionTable:
    """A mapped view of the shared admission counts; `worker` is the column this
    process writes (None: the supervisor, which only zeroes a dead worker's)."""

    #: other processes change these counts too: a waiting request polls for a slot
    shared = True

    def __init__(self, path: str | Path, workers: int, worker: int | None) -> None:
        self.workers, self.worker = workers, worker
        signals = _WAITING + len(PRIORITIES)
        self._rows = signals + ROWS
        counts = self._rows * workers
        self._map = map_shared(path, (counts + 2 * SESSION_SLOTS) * _INT64)
        self._words = memoryview(self._map).cast("q")
        self._sessions = self._words[counts:]
        self._signals = self._words[signals * workers : counts]
        #: this worker's flow signals (the supervisor's column: none, never written)
        self.cells = FlowCells(self._signals, workers, worker or 0)
        self._lock_fd = os.open(path, os.O_RDONLY)  # flock is per open file

    def key(self, tenant: str) -> int:
        """The row `tenant` is counted in."""
        return 1 + xxhash.xxh3_64_intdigest(tenant.encode()) % TENANT_SLOTS

    def take(self, row: int, cap: int) -> bool:
        """Count one more request in `row` if the router-wide count stays within `cap`."""
        words, workers = self._words, self.workers
        start = row * workers
        own = start + self.worker
        words[own] += 1
        if sum(words[start : start + workers]) + workers - 1 <= cap:
            return True
        locked = lock_within(self._lock_fd, _LOCK_WAIT_S)
        try:
            if sum(words[start : start + workers]) <= cap:
                return True
            words[own] -= 1
            return False
        finally:
            if locked:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def give(self, row: int) -> None:
        self._words[row * self.workers + self.worker] -= 1

    def count(self, row: int) -> int:
        start = row * self.workers
        return sum(self._words[start : start + self.workers])

    def set_waiting(self, rank: int, depth: int) -> None:
        """This worker's waiters of class `rank` now."""
        self._words[(_WAITING + rank) * self.workers + self.worker] = depth

    def waiting_above(self, rank: int) -> bool:
        """Does another worker have a waiter of a class above `rank`?"""
        words, workers, own = self._words, self.workers, self.worker
        for above in range(rank):
            start = (_WAITING + above) * workers
            row = words[start : start + workers]
            if sum(row) - row[own] > 0:
                return True
        return False

    def waiting_in(self, ranks: range) -> bool:
        """Does any worker have a waiter of a class in `ranks`?"""
        words, workers = self._words, self.workers
        start = (_WAITING + ranks.start) * workers
        return any(words[start : start + len(ranks) * workers])

    def clear_worker(self, worker: int) -> None:
        """Zero a dead worker's column: its requests ended with it."""
        zeros = memoryview(bytes(self._rows * _INT64)).cast("q")
        self._words[worker : self._rows * self.workers : self.workers] = zeros

    @property
    def sessions(self) -> AdmissionTable:
        """The session records every worker shares (`recall`, `record`)."""
        return self

    def recall(self, key: int) -> tuple[int, float] | None:
        """The session `key`'s record: its backend's name hash, and when it was last used."""
        at = 2 * (key % SESSION_SLOTS)
        if self._sessions[at] != _signed(key):
            return None
        packed = self._sessions[at + 1] & 0xFFFFFFFFFFFFFFFF
        return packed >> 32, float(packed & 0xFFFFFFFF)

    def record(self, key: int, backend: int, at: float) -> None:
        slot = 2 * (key % SESSION_SLOTS)
        self._sessions[slot] = _signed(key)
        self._sessions[slot + 1] = _signed((backend & 0xFFFFFFFF) << 32 | int(at) & 0xFFFFFFFF)

    def close(self) -> None:
        self._signals.release()
        self._sessions.release()
        self._words.release()
        self._map.close()
        os.close(self._lock_fd)


def _signed(value: int) -> int:
    """An unsigned 64-bit value as the int64 the table holds."""
    return value - (1 << 64) if value >= 1 << 63 else value
