"""What both job stores do alike, written once: the wall clock read once per call and
the deadlines taken from it, the records a call answers with, the tenant's rule (a job
of another tenant, or a batch's line, is as good as absent), a listing's page, a file
read a piece at a time, and a batch's end in its order (checked, its lines' outcomes
written out, ended).

`JobsLogic`, `FilesLogic` and `BatchesLogic` give the JobStore calls (store.py says
what each does); a store (sqlite_store.py, redis_store.py) gives only the storage's
calls they name with a `_`, each declared here. What must happen at once (a claim, a
result, a batch's end) happens in one storage call: a SQLite transaction, a Redis
Lua script.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Generic, NamedTuple, TypeVar

from router.jobs.store import PIECE_BYTES, Job, Layout, Outcome, Page, StoredFile, Writer

T = TypeVar("T")
H = TypeVar("H")
#: a batch's output and error files: their ids, then their contents
Outputs = tuple[tuple[str, str], tuple[bytes, bytes]]


def page(items: list[T], limit: int) -> Page[T]:
    """The first `limit` of `items` (read `limit + 1` for it), and whether more follow."""
    return Page(items[:limit], len(items) > limit)


class JobsLogic:
    """The job calls (JobStore's first half), over the store's `_add_job`, `_job`,
    `_lease_next`, `_renew`, `_finish`, `_lease_hook` and `_hook_tried`; `release`,
    `expire` and `unsettled` are the store's own."""

    def put(
        self, job_id: str, tenant: str | None, path: str, body: bytes, webhook: str | None = None
    ) -> Job:
        now = time.time()
        job = Job(job_id, tenant, path, body, "queued", now, now, 0, None, None, None, webhook)
        self._add_job(job)
        return job

    def get(self, job_id: str, tenant: str | None) -> Job | None:
        job = self._job(job_id)
        if job is None or job.batch_id is not None or job.tenant != tenant:
            return None
        return job

    def claim(self, owner: str, lease_s: float) -> Job | None:
        now = time.time()
        return self._lease_next(owner, now, now + lease_s)

    def renew(self, job_id: str, owner: str, lease_s: float) -> bool:
        return self._renew(job_id, owner, time.time() + lease_s)

    def finish(
        self, job_id: str, owner: str, status: str, code: int, result: bytes, ttl_s: float
    ) -> bool:
        return self._finish(job_id, owner, status, code, result, time.time(), ttl_s)

    def due_hook(self, lease_s: float) -> Job | None:
        now = time.time()
        return self._lease_hook(now, now + lease_s)

    def hook_tried(self, job_id: str, state: str, retry_in: float) -> None:
        self._hook_tried(job_id, state, time.time() + retry_in)

    def _add_job(self, job: Job) -> None:
        """Store a new job, queued (committed before this returns)."""
        raise NotImplementedError

    def _job(self, job_id: str) -> Job | None:
        """The job, whoever's it is."""
        raise NotImplementedError

    def _lease_next(self, owner: str, now: float, until: float) -> Job | None:
        """The next job waiting, or running under a lease over by `now`, leased to
        `owner` until `until` with one more attempt."""
        raise NotImplementedError

    def _renew(self, job_id: str, owner: str, until: float) -> bool:
        """`owner`'s lease on the running job to `until`; False if it is not theirs."""
        raise NotImplementedError

    def _finish(
        self, job_id: str, owner: str, status: str, code: int, result: bytes,
        now: float, ttl_s: float,
    ) -> bool:  # fmt: skip
        """The job's result at `now`, if `owner` still runs it: kept `ttl_s` unless it
        is a batch's line, its webhook due."""
        raise NotImplementedError

    def _lease_hook(self, now: float, until: float) -> Job | None:
        """A job whose webhook is due by `now`, due again at `until`."""
        raise NotImplementedError

    def _hook_tried(self, job_id: str, state: str, due: float) -> None:
        """One delivery more, the webhook now `state` (due at `due` if "pending")."""
        raise NotImplementedError


class FilesLogic:
    """The file calls that store: a file's record and its TTL from one clock reading, and
    reading a stored file a piece at a time (the bytes written whole, in slices of
    `PIECE_BYTES`, then the pieces it was uploaded in). The store gives `_add_file`,
    `_add_part`, `_seal`, `layout`, `_written` and `_part`; the rest of the file calls
    are its own."""

    def put_file(
        self, file_id: str, tenant: str | None, purpose: str, filename: str, content: bytes,
        ttl_s: float,
    ) -> StoredFile:  # fmt: skip
        stored = StoredFile(file_id, purpose, filename, time.time(), len(content))
        self._add_file(stored, tenant, content, ttl_s)
        return stored

    def put_part(
        self, file_id: str, tenant: str | None, n: int, data: bytes, ttl_s: float, quota: int
    ) -> bool:
        now = time.time()
        return self._add_part(file_id, tenant, n, data, now, now + ttl_s, quota)

    def seal_file(
        self, file_id: str, tenant: str | None, purpose: str, filename: str, ttl_s: float
    ) -> StoredFile:
        now = time.time()
        size = self._seal(file_id, tenant, purpose, filename, now, ttl_s)
        return StoredFile(file_id, purpose, filename, now, size)

    def piece(self, file_id: str, layout: Layout, n: int) -> bytes | None:
        slices = -(-layout.written // PIECE_BYTES)
        if n < slices:
            start = n * PIECE_BYTES
            return self._written(file_id, start, min(PIECE_BYTES, layout.written - start))
        return self._part(file_id, n - slices)

    def content(self, file_id: str, tenant: str | None) -> bytes | None:
        layout = self.layout(file_id, tenant)
        if layout is None:
            return None
        whole = bytearray()
        for n in range(layout.pieces()):
            whole += self.piece(file_id, layout, n) or b""
        return bytes(whole)

    def _add_file(
        self, stored: StoredFile, tenant: str | None, content: bytes, ttl_s: float
    ) -> None:
        """Store a whole file, kept `ttl_s` from its creation."""
        raise NotImplementedError

    def _add_part(
        self, file_id: str, tenant: str | None, n: int, data: bytes, now: float, until: float,
        quota: int,
    ) -> bool:  # fmt: skip
        """Keep piece `n` of an upload until `until`; False, keeping nothing, if the
        tenant's uploads kept past `now` would then pass `quota` bytes."""
        raise NotImplementedError

    def _seal(
        self, file_id: str, tenant: str | None, purpose: str, filename: str,
        now: float, ttl_s: float,
    ) -> int:  # fmt: skip
        """The upload's pieces, now a file made at `now` and kept `ttl_s` with them; its
        size."""
        raise NotImplementedError

    def layout(self, file_id: str, tenant: str | None) -> Layout | None:
        raise NotImplementedError

    def _written(self, file_id: str, start: int, size: int) -> bytes | None:
        """`size` bytes from `start` of what was written whole (None: the file went)."""
        raise NotImplementedError

    def _part(self, file_id: str, n: int) -> bytes | None:
        """Uploaded piece `n` (None: the file went)."""
        raise NotImplementedError


class Ending(NamedTuple, Generic[H]):
    """A batch found open with none of its lines waiting or running: its lines'
    outcomes, in input order, and the store's `handle` to end it with."""

    outcomes: list[Outcome]
    handle: H


class BatchesLogic(Generic[H]):
    """A batch's cancel and its end, in their order: the store's `_ending` finds the
    batch ready to end (and holds it, where the store can), the caller's `write` turns
    its outcomes into its files' contents, the store's `_end` ends it. `put_batch`,
    `batch`, `batches` and `unsettled` are the store's own."""

    def cancel_batch(self, batch_id: str, tenant: str | None) -> bool:
        return self._cancel(batch_id, tenant, time.time())

    def settle(self, batch_id: str, files: tuple[str, str], write: Writer, ttl_s: float) -> bool:
        with self._ending(batch_id) as ending:
            if ending is None:
                return False
            contents = write(ending.outcomes)
            return self._end(batch_id, ending, (files, contents), time.time(), ttl_s)

    def _cancel(self, batch_id: str, tenant: str | None, now: float) -> bool:
        """The tenant's batch cancelling since `now`, its waiting lines cancelled; False
        if it was not in progress."""
        raise NotImplementedError

    def _ending(self, batch_id: str) -> AbstractContextManager[Ending[H] | None]:
        """The batch, if it is open and none of its lines waits or runs (else None)."""
        raise NotImplementedError

    def _end(
        self, batch_id: str, ending: Ending[H], outputs: Outputs, now: float, ttl_s: float
    ) -> bool:
        """End the batch at `now`, kept `ttl_s`: its output and error files (`outputs`:
        their ids, their contents; each only if it has a line), its counts and final
        state, its lines dropped. True if this call ended it."""
        raise NotImplementedError
