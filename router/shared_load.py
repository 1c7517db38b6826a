"""Router-wide in-flight counts shared by the worker processes (`serve --workers N`).

One file in shared memory (a tmpfs under the supervisor's run directory), mapped by
every worker. Layout: `slots` backend keys (uint64, 0 = free), then per slot two
counters (requests in flight, prompt tokens queued) with one int64 per worker:

    [key_0 .. key_{S-1}] [slot 0: inflight w0..wN-1, tokens w0..wN-1] [slot 1: ...]

A worker only ever writes its own column, so an increment is a plain read-modify-write
with no lock; readers sum a contiguous run of N int64s (one C-level `sum` over a
memoryview slice). Aligned 8-byte stores are single instructions on the platforms we
run on, so a reader never sees a torn value. When a worker dies the supervisor zeroes
its column before starting its replacement: its requests died with it, so the
router-wide sums are right again at once.

Slots are claimed once per backend (when its `Backend` is built, never per request),
by open addressing on a hash of its name and URL under an `flock`, so two workers that
add the same backend agree on its slot. Slots are never freed: the table is sized at
start for `slots` distinct backends over the router's life (discovery churn included);
a backend that finds it full counts locally only and a warning says so.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path

import xxhash

from router import log

_INT64 = 8


class LoadTable:
    """A mapped view of the shared counters; `worker` is the column this process writes."""

    def __init__(self, path: str | Path, slots: int, workers: int, worker: int | None) -> None:
        self.path = str(path)
        self.slots, self.workers, self.worker = slots, workers, worker
        size = slots * _INT64 * (1 + 2 * workers)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("q")
        self._keys = memoryview(self._map).cast("Q")[:slots]

    def slot(self, name: str, url: str) -> int | None:
        """The backend's slot, claimed on first use; None when the table is full."""
        key = xxhash.xxh3_64_intdigest(f"{name}\0{url}".encode()) or 1
        found = self._probe(key)
        if found is not None and self._keys[found] == key:
            return found
        with open(self.path, "rb") as f:  # claims are rare: a lock on the whole file
            fcntl.flock(f, fcntl.LOCK_EX)
            found = self._probe(key)
            if found is None:
                log.server.warning("shared load table full: %s counts per worker only", name)
                return None
            self._keys[found] = key
            return found

    def _probe(self, key: int) -> int | None:
        """The slot holding `key`, else the first free one on its probe path."""
        start = key % self.slots
        for i in range(self.slots):
            slot = (start + i) % self.slots
            held = self._keys[slot]
            if held == key or held == 0:
                return slot
        return None

    def _base(self, slot: int) -> int:
        return self.slots + slot * 2 * self.workers

    def add(self, slot: int, requests: int, tokens: int) -> None:
        """Count this worker's requests and queued tokens to a backend up or down."""
        words, i = self._words, self._base(slot) + self.worker
        words[i] += requests
        words[i + self.workers] += tokens

    def inflight(self, slot: int) -> int:
        base = self._base(slot)
        return sum(self._words[base : base + self.workers])

    def queued_tokens(self, slot: int) -> int:
        base = self._base(slot) + self.workers
        return sum(self._words[base : base + self.workers])

    def clear_worker(self, worker: int) -> None:
        """Zero a dead worker's column: its in-flight requests ended with it."""
        for slot in range(self.slots):
            i = self._base(slot) + worker
            self._words[i] = 0
            self._words[i + self.workers] = 0

    def close(self) -> None:
        self._keys.release()
        self._words.release()
        self._map.close()
