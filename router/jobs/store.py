"""What the job stores keep, and what a store does: the records (a job, a stored file, a
batch, a batch line, a finished line) and `JobStore`, which the SQLite store
(sqlite_store.py, one host) and the Redis store (redis_store.py, several router
replicas) both are, their common steps in logic.py; stores.py opens the one the config
names.

A job is accepted once it is stored, and only then answered. A worker runs it under a
lease (`claim`): the lease names the worker and runs out `lease_s` after it was last
renewed, so a worker killed mid-job (`kill -9`) leaves a lease that runs out, and any
worker, that router's next start included, claims the job again. That is
at-least-once: each attempt is counted. A result is kept until its TTL, then dropped
with its job; a batch's lines are dropped once its output file is written, and its TTL
counts from its end, however long it ran. Every call
blocks; callers run them in a thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, NamedTuple, Protocol, TypeVar

#: a batch's states before it ends (OpenAI's names)
OPEN_BATCH = ("in_progress", "cancelling")
#: starts the owner of what a token without a tenant stores (no tenant id spells it)
TOKEN_OWNER = "~token/"
#: a file is stored, and read back, in pieces of about this size
PIECE_BYTES = 1 << 20


def runs_as(owner: str | None) -> str | None:
    """The tenant a job runs as: its owner, unless that is a token's own namespace
    (such a token names no tenant, and its digest stays out of metrics and logs)."""
    return None if owner is not None and owner.startswith(TOKEN_OWNER) else owner


class Job(NamedTuple):
    id: str
    tenant: str | None
    path: str
    body: bytes
    status: str
    created: float
    updated: float
    attempts: int
    result_status: int | None
    result: bytes | None
    batch_id: str | None
    #: where its status is POSTed when it ends, and how that went: None, "pending",
    #: "delivered" or "failed" (every attempt refused)
    webhook: str | None = None
    hook_state: str | None = None
    hook_attempts: int = 0


class StoredFile(NamedTuple):
    id: str
    purpose: str
    filename: str
    created: float
    size: int


class Layout(NamedTuple):
    """How a stored file's bytes are kept: `written` bytes written whole (a batch's
    output), then `parts` pieces it was uploaded in; `size` in all."""

    size: int
    written: int
    parts: int

    def pieces(self) -> int:
        """How many pieces `JobStore.piece` reads it in."""
        return -(-self.written // PIECE_BYTES) + self.parts


class Batch(NamedTuple):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: bytes | None
    status: str
    errors: bytes | None
    total: int
    completed: int
    failed: int
    output_file_id: str | None
    error_file_id: str | None
    created: float
    in_progress_at: float | None
    cancelling_at: float | None
    finished_at: float | None
    expires: float | None


class Line(NamedTuple):
    """A batch input line, checked: its job's id, custom_id, endpoint path and body."""

    id: str
    custom_id: str
    path: str
    body: bytes


class Outcome(NamedTuple):
    """A finished batch line, for its output file."""

    id: str
    custom_id: str
    status: int
    body: bytes


T = TypeVar("T")


class Page(NamedTuple, Generic[T]):
    """One page of a listing, and whether more follow it."""

    items: list[T]
    more: bool


#: turns a batch's finished lines into its output and error files' contents
Writer = Callable[[list[Outcome]], tuple[bytes, bytes]]


class JobStore(Protocol):
    """A store of jobs, files and batches (each call blocks)."""

    #: the exceptions that are the store failing, not a bug (faults.py makes them 503s)
    errors: tuple[type[Exception], ...]

    def reason(self, exc: Exception) -> str:
        """What failed, in a few words a client may read (no path, no address)."""

    def put(
        self, job_id: str, tenant: str | None, path: str, body: bytes, webhook: str | None = None
    ) -> Job:
        """Accept a job: stored before this returns."""

    def get(self, job_id: str, tenant: str | None) -> Job | None:
        """The async job, if it is `tenant`'s (another tenant's is as good as absent)."""

    def claim(self, owner: str, lease_s: float) -> Job | None:
        """The next job waiting (single async jobs before batch lines), or one running
        under a lease that ran out, now leased to `owner` with one more attempt."""

    def renew(self, job_id: str, owner: str, lease_s: float) -> bool:
        """Extend `owner`'s lease; False if it lost the job (its lease ran out)."""

    def finish(
        self, job_id: str, owner: str, status: str, code: int, result: bytes, ttl_s: float
    ) -> bool:
        """Record the job's result, if `owner` still holds it (False if not); its
        webhook, if it has one, is due now."""

    def release(self, owner: str) -> int:
        """Put `owner`'s running jobs back in the queue (a worker stopping); how many."""

    def expire(self) -> int:
        """Drop what is past its TTL (where the store does not itself); how many. A
        batch's lines go with their batch, never before it ends."""

    def unsettled(self) -> list[str]:
        """The open batches none of whose lines waits or runs: the worker that ended
        the last one died before it settled the batch."""

    def due_hook(self, lease_s: float) -> Job | None:
        """A finished job whose webhook is due, leased for `lease_s` (a worker that dies
        delivering leaves it due again then)."""

    def hook_tried(self, job_id: str, state: str, retry_in: float) -> None:
        """One delivery attempt made: now `state` ("pending" to retry in `retry_in`)."""

    def put_file(
        self,
        file_id: str,
        tenant: str | None,
        purpose: str,
        filename: str,
        content: bytes,
        ttl_s: float,
    ) -> StoredFile: ...

    def put_part(
        self, file_id: str, tenant: str | None, n: int, data: bytes, ttl_s: float, quota: int
    ) -> bool:
        """Keep piece `n` of an upload, unseen until `seal_file`; False, keeping
        nothing, if the tenant's uploads would then pass `quota` bytes."""

    def seal_file(
        self, file_id: str, tenant: str | None, purpose: str, filename: str, ttl_s: float
    ) -> StoredFile:
        """The upload whose pieces `put_part` kept, now a file (they expire with it)."""

    def drop_parts(self, file_id: str, tenant: str | None) -> None:
        """Forget an upload that did not end."""

    def file(self, file_id: str, tenant: str | None) -> StoredFile | None: ...

    def layout(self, file_id: str, tenant: str | None) -> Layout | None:
        """How the tenant's file is kept, to read it a piece at a time."""

    def piece(self, file_id: str, layout: Layout, n: int) -> bytes | None:
        """Piece `n` (of `layout.pieces()`) of the file; None if it went meanwhile."""

    def content(self, file_id: str, tenant: str | None) -> bytes | None:
        """The tenant's whole file."""

    def files(
        self, tenant: str | None, purpose: str | None, after: str | None, limit: int
    ) -> Page[StoredFile]:
        """The tenant's files (of `purpose`, if given), newest first, from the one after
        `after`."""

    def delete_file(self, file_id: str, tenant: str | None) -> bool:
        """Drop the tenant's file; False if there was none."""

    def put_batch(self, batch: Batch, tenant: str | None, lines: Sequence[Line]) -> None:
        """Accept a batch and its lines as jobs, at once."""

    def batch(self, batch_id: str, tenant: str | None) -> Batch | None:
        """The batch, with its counts so far while it runs."""

    def batches(self, tenant: str | None, after: str | None, limit: int) -> Page[Batch]:
        """The tenant's batches, newest first, from the one after `after`."""

    def cancel_batch(self, batch_id: str, tenant: str | None) -> bool:
        """Stop a batch's waiting lines (those running finish); False if it had ended."""

    def settle(self, batch_id: str, files: tuple[str, str], write: Writer, ttl_s: float) -> bool:
        """End the batch if none of its lines waits or runs: its output and error files
        (ids `files`) from `write`, its counts and state, its lines dropped. True if
        this call ended it (once, however many workers try)."""
