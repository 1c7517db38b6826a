"""Router-wide in-flight counts shared by the worker processes (`serve --workers N`).

One file in shared memory (a tmpfs under the supervisor's run directory), mapped by
every worker. Layout: `slots` backend keys (uint64, 0 = never used), then per slot
four counters (requests in flight, prompt tokens queued, whether the worker holds the
backend, and requests whose answer has not begun) with one int64 per worker:

    [key_0 .. key_{S-1}] [slot 0: inflight w0.., tokens w0.., held w0.., unstarted w0..] ...

and after them, per slot and worker, the samples of the backend's speed that worker took
(`SPEED_WORDS` float64s, router/fleet/speeds.py), which every worker reads; then one
int64 per worker: the turns it took (`take`: ROUND_ROBIN's rotation is the router's,
the sum of every worker's turns); last, one int64 per worker: the backends whose first
speed it learned (`count_learned`: the others then learn them from the same samples).

A worker only ever writes its own column, so an increment is a plain read-modify-write
with no lock; readers sum a contiguous run of N int64s (one C-level `sum` over a
memoryview slice). Aligned 8-byte stores are single instructions on the platforms we
run on, so a reader never sees a torn value. When a worker dies the supervisor zeroes
its column before starting its replacement: its requests died with it, so the
router-wide sums are right again at once.

Slots are claimed when a `Backend` is built (never per request), by open addressing on
a hash of its name and URL under an `flock`, so two workers that add the same backend
agree on its slot. A worker lets go of a slot when the backend has left its fleet and
its last request there ended (`release`); a slot no worker holds, with nothing in
flight, is reused by the next claim on its probe path, so discovery churn (pods coming
and going) does not fill the table. Keys stay in reused slots' places, so a probe path
is never cut. A backend that finds the table full counts locally only and a warning
says so.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time
from pathlib import Path

import xxhash

from router import log
from router.fleet.speeds import WORDS as SPEED_WORDS

_INT64 = 8
#: counters per slot, one int64 per worker each
_COUNTERS = 4


def _zeros(n: int) -> memoryview:
    return memoryview(bytes(n * _INT64)).cast("q")


def map_shared(path: str | Path, size: int) -> mmap.mmap:
    """`size` bytes of the file at `path`, created (zeroed) by whichever process is first."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def lock_within(fd: int, seconds: float) -> bool:
    """Take an exclusive `flock` on `fd` if it comes within `seconds` (uncontended: one
    system call), yielding the core meanwhile: the holder may be waiting for it. A
    holder descheduled on a busy machine must not stall this worker's event loop longer,
    so past that the caller goes ahead without the lock (False)."""
    deadline = time.perf_counter() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.perf_counter() > deadline:
                return False
            os.sched_yield()


def _key(name: str, url: str) -> int:
    """A backend's key in the table (0 marks a never-used slot)."""
    return xxhash.xxh3_64_intdigest(f"{name}\0{url}".encode()) or 1


class LoadTable:
    """A mapped view of the shared counters; `worker` is the column this process writes."""

    def __init__(self, path: str | Path, slots: int, workers: int, worker: int | None) -> None:
        self.path = str(path)
        self.slots, self.workers, self.worker = slots, workers, worker
        counters = slots * _INT64 * (1 + _COUNTERS * workers)
        turns = counters + slots * workers * SPEED_WORDS * _INT64
        learned = turns + workers * _INT64
        self._map = map_shared(self.path, learned + workers * _INT64)
        self._words = memoryview(self._map)[:counters].cast("q")
        self._keys = memoryview(self._map)[:counters].cast("Q")[:slots]
        self._speeds = memoryview(self._map)[counters:turns].cast("d")
        self._turns = memoryview(self._map)[turns:learned].cast("q")
        self._learned = memoryview(self._map)[learned:].cast("q")

    def slot(self, name: str, url: str) -> int | None:
        """The backend's slot, claimed and held by this worker; None when the table is full."""
        key = _key(name, url)
        with open(self.path, "rb") as f:  # claims are rare: a lock on the whole file
            fcntl.flock(f, fcntl.LOCK_EX)
            found = self._claim(key)
            if found is None:
                log.server.warning("shared load table full: %s counts per worker only", name)
                return None
            self._words[self._base(found) + 2 * self.workers + self.worker] = 1
            return found

    def find(self, name: str, url: str) -> int | None:
        """The slot some worker claimed for the backend, without claiming it (the
        collector reads the router's load: router/telemetry/cluster.py)."""
        key = _key(name, url)
        start = key % self.slots
        for i in range(self.slots):
            held = self._keys[(start + i) % self.slots]
            if held == key:
                return (start + i) % self.slots
            if held == 0:
                return None
        return None

    def release(self, slot: int) -> None:
        """This worker is done with the slot's backend (gone from its fleet, idle)."""
        self._words[self._base(slot) + 2 * self.workers + self.worker] = 0

    def _claim(self, key: int) -> int | None:
        """The slot holding `key`, else the first reusable one on its probe path (never
        used, or held by no worker with nothing counted), reset for `key`."""
        start = key % self.slots
        reusable = None
        for i in range(self.slots):
            slot = (start + i) % self.slots
            held = self._keys[slot]
            if held == key:
                return slot
            if held == 0:  # the end of the path: `key` is nowhere further
                reusable = slot if reusable is None else reusable
                break
            if reusable is None and self._idle(slot):
                reusable = slot
        if reusable is not None:
            base = self._base(reusable)
            self._words[base : base + _COUNTERS * self.workers] = _zeros(_COUNTERS * self.workers)
            for column in self.speed_columns(reusable):  # another backend's samples
                column[:] = _zeros(SPEED_WORDS).cast("B").cast("d")
            self._keys[reusable] = key
        return reusable

    def _idle(self, slot: int) -> bool:
        base = self._base(slot)
        return not any(self._words[base : base + _COUNTERS * self.workers])

    def _base(self, slot: int) -> int:
        return self.slots + slot * _COUNTERS * self.workers

    def add(self, slot: int, requests: int, tokens: int, unstarted: int) -> None:
        """Count this worker's requests, queued tokens and requests whose answer has not
        begun to a backend up or down."""
        words, i = self._words, self._base(slot) + self.worker
        words[i] += requests
        words[i + self.workers] += tokens
        words[i + 3 * self.workers] += unstarted

    def inflight(self, slot: int) -> int:
        base = self._base(slot)
        return sum(self._words[base : base + self.workers])

    def queued_tokens(self, slot: int) -> int:
        base = self._base(slot) + self.workers
        return sum(self._words[base : base + self.workers])

    def unstarted(self, slot: int) -> int:
        base = self._base(slot) + 3 * self.workers
        return sum(self._words[base : base + self.workers])

    def speed_columns(self, slot: int) -> list[memoryview]:
        """Every worker's samples of the slot's backend's speed, in worker order."""
        return [self.speed_column(slot, w) for w in range(self.workers)]

    def speed_column(self, slot: int, worker: int) -> memoryview:
        """One worker's samples of the slot's backend's speed."""
        start = (slot * self.workers + worker) * SPEED_WORDS
        return self._speeds[start : start + SPEED_WORDS]

    def take(self) -> int:
        """The router's next turn: every worker's turns so far, this one counted as
        taken. Two workers taking theirs within the same few µs may get the same one."""
        turns = self._turns
        turn = sum(turns)
        turns[self.worker] += 1
        return turn

    def count_learned(self) -> None:
        """This worker just learned a backend's first speed from the shared samples."""
        self._learned[self.worker] += 1

    def learned(self) -> int:
        """The first speeds every worker learned so far: when it grew, another worker's
        samples may have given a backend this one has not learned yet its speed."""
        return sum(self._learned)

    def clear_worker(self, worker: int) -> None:
        """Zero a dead worker's column: its requests ended, its backends went with it."""
        for slot in range(self.slots):
            i = self._base(slot) + worker
            self._words[i : i + _COUNTERS * self.workers : self.workers] = _zeros(_COUNTERS)

    def close(self) -> None:
        self._keys.release()
        self._words.release()
        self._speeds.release()
        self._turns.release()
        self._learned.release()
        self._map.close()
