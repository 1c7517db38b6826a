"""The job store on one host: the jobs, files and batches in the SQLite database that
every worker shares (sqlite_db.py: the file, its schema, its transactions, its reserve
for a full disk). Leases, attempts and TTLs as store.py says, the calls' common steps in
logic.py; expired rows are deleted by `expire`, which each worker calls now and then.
Each part below is the SQL of one of JobStore's halves: jobs, files, batches.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from typing import NamedTuple

from router.jobs.logic import BatchesLogic, Ending, FilesLogic, JobsLogic, Outputs, page
from router.jobs.sqlite_db import SqliteDb
from router.jobs.store import OPEN_BATCH, Batch, Job, Layout, Line, Outcome, Page, StoredFile

_JOB = ", ".join(Job._fields)
#: newest first, past the row `after` names: every row when it is NULL, none when the
#: tenant has no row with that id (a cursor gone, or another tenant's, is the end, never
#: the start again); its parameters are that id, the id again and the tenant
_AFTER = (
    "(? IS NULL OR (created, id) < (SELECT created, id FROM {table} WHERE id = ? AND tenant IS ?))"
)
_BATCH = ", ".join(Batch._fields)
#: what `expire` drops: the tables, each with what else a row must be
_EXPIRING = (
    ("jobs", " AND batch_id IS NULL"),
    ("batches", ""),
    ("files", ""),
    ("file_parts", ""),
)
#: a file's size: what it holds, and the pieces it was uploaded in
_SIZE = (
    "length(content) + "
    "(SELECT coalesce(sum(length(data)), 0) FROM file_parts WHERE file_id = files.id)"
)
_ADD_FILE = (
    "INSERT INTO files (id, tenant, purpose, filename, created, content, expires) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)


class SqliteJobs(JobsLogic, SqliteDb):
    """The jobs table: a job's lease, its result, its webhook's deliveries."""

    def _add_job(self, job: Job) -> None:
        self._room()
        with closing(self._connect()) as db:
            db.execute(
                "INSERT INTO jobs (id, tenant, path, body, status, created, updated, webhook) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (*job[:7], job.webhook),
            )

    def _job(self, job_id: str) -> Job | None:
        with closing(self._connect()) as db:
            row = db.execute(f"SELECT {_JOB} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else Job(*row)

    def _lease_next(self, owner: str, now: float, until: float) -> Job | None:
        """The oldest job waiting (single async jobs before batch lines), or running
        under a lease that ran out."""
        with closing(self._connect()) as db:
            row = db.execute(
                "UPDATE jobs SET status = 'running', owner = ?, lease_until = ?, "
                "attempts = attempts + 1, updated = ? WHERE id = (SELECT id FROM jobs "
                "WHERE status = 'queued' OR (status = 'running' AND lease_until < ?) "
                f"ORDER BY batch_id IS NOT NULL, created, line LIMIT 1) RETURNING {_JOB}",
                (owner, until, now, now),
            ).fetchone()
        return None if row is None else Job(*row)

    def _renew(self, job_id: str, owner: str, until: float) -> bool:
        with closing(self._connect()) as db:
            done = db.execute(
                "UPDATE jobs SET lease_until = ? WHERE id = ? AND owner = ? AND status = 'running'",
                (until, job_id, owner),
            )
        return done.rowcount == 1

    def _finish(
        self, job_id: str, owner: str, status: str, code: int, result: bytes,
        now: float, ttl_s: float,
    ) -> bool:  # fmt: skip
        with closing(self._connect()) as db:
            done = db.execute(
                "UPDATE jobs SET status = ?, result_status = ?, result = ?, updated = ?, "
                "expires = CASE WHEN batch_id IS NULL THEN ? END, owner = NULL, "
                "hook_state = CASE WHEN webhook IS NULL THEN NULL "
                "ELSE 'pending' END WHERE id = ? AND owner = ? AND status = 'running'",
                (status, code, result, now, now + ttl_s, job_id, owner),
            )
        return done.rowcount == 1

    def _lease_hook(self, now: float, until: float) -> Job | None:
        with closing(self._connect()) as db:
            row = db.execute(
                "UPDATE jobs SET hook_due = ? WHERE id = (SELECT id FROM jobs WHERE "
                "hook_state = 'pending' AND hook_due <= ? ORDER BY hook_due LIMIT 1) "
                f"RETURNING {_JOB}",
                (until, now),
            ).fetchone()
        return None if row is None else Job(*row)

    def _hook_tried(self, job_id: str, state: str, due: float) -> None:
        with closing(self._connect()) as db:
            db.execute(
                "UPDATE jobs SET hook_state = ?, hook_attempts = hook_attempts + 1, "
                "hook_due = ? WHERE id = ?",
                (state, due, job_id),
            )

    def release(self, owner: str) -> int:
        """Put `owner`'s running jobs back in the queue (a worker stopping); how many."""
        with closing(self._connect()) as db:
            return db.execute(
                "UPDATE jobs SET status = 'queued', owner = NULL, lease_until = 0 "
                "WHERE owner = ? AND status = 'running'",
                (owner,),
            ).rowcount

    def expire(self) -> int:
        """Drop what is past its TTL (finished async jobs, ended batches, files); how
        many. A batch's lines are not: they go when it ends (an older release gave
        them a TTL of their own)."""
        now = time.time()
        return self._freeing(
            lambda db: sum(
                db.execute(f"DELETE FROM {table} WHERE expires < ?{only}", (now,)).rowcount
                for table, only in _EXPIRING
            )
        )


class SqliteFiles(FilesLogic, SqliteDb):
    """The files table, and the pieces an upload arrives in (`file_parts`)."""

    def _add_file(
        self, stored: StoredFile, tenant: str | None, content: bytes, ttl_s: float
    ) -> None:
        self._room()
        file_id, purpose, filename, now, _ = stored
        with closing(self._connect()) as db:
            db.execute(_ADD_FILE, (file_id, tenant, purpose, filename, now, content, now + ttl_s))

    def file(self, file_id: str, tenant: str | None) -> StoredFile | None:
        with closing(self._connect()) as db:
            row = db.execute(
                f"SELECT id, purpose, filename, created, {_SIZE} FROM files "
                "WHERE id = ? AND tenant IS ?",
                (file_id, tenant),
            ).fetchone()
        return None if row is None else StoredFile(*row)

    def _add_part(
        self, file_id: str, tenant: str | None, n: int, data: bytes, now: float, until: float,
        quota: int,
    ) -> bool:  # fmt: skip
        self._room()
        with self._transaction() as db:
            (used,) = db.execute(
                "SELECT coalesce(sum(length(data)), 0) FROM file_parts "
                "WHERE tenant IS ? AND expires >= ?",
                (tenant, now),
            ).fetchone()
            if used + len(data) > quota:
                return False
            db.execute(
                "INSERT INTO file_parts (file_id, n, tenant, data, expires) VALUES (?, ?, ?, ?, ?)",
                (file_id, n, tenant, data, until),
            )
        return True

    def _seal(
        self, file_id: str, tenant: str | None, purpose: str, filename: str,
        now: float, ttl_s: float,
    ) -> int:  # fmt: skip
        with self._transaction() as db:
            db.execute(_ADD_FILE, (file_id, tenant, purpose, filename, now, b"", now + ttl_s))
            db.execute(
                "UPDATE file_parts SET expires = ? WHERE file_id = ?", (now + ttl_s, file_id)
            )
            (size,) = db.execute(
                "SELECT coalesce(sum(length(data)), 0) FROM file_parts WHERE file_id = ?",
                (file_id,),
            ).fetchone()
        return size

    def drop_parts(self, file_id: str, tenant: str | None) -> None:
        """Forget an upload that did not end, on a full disk too."""
        query = "DELETE FROM file_parts WHERE file_id = ?"
        self._freeing(lambda db: db.execute(query, (file_id,)).rowcount)

    def layout(self, file_id: str, tenant: str | None) -> Layout | None:
        with closing(self._connect()) as db:
            row = db.execute(
                "SELECT length(content), (SELECT coalesce(sum(length(data)), 0) "
                "FROM file_parts WHERE file_id = files.id), "
                "(SELECT count(*) FROM file_parts WHERE file_id = files.id) "
                "FROM files WHERE id = ? AND tenant IS ?",
                (file_id, tenant),
            ).fetchone()
        return None if row is None else Layout(row[0] + row[1], row[0], row[2])

    def _written(self, file_id: str, start: int, size: int) -> bytes | None:
        """Read through SQLite's blob I/O: only the slice is loaded."""
        with closing(self._connect()) as db:
            row = db.execute("SELECT rowid FROM files WHERE id = ?", (file_id,)).fetchone()
            if row is None:
                return None
            with db.blobopen("files", "content", row[0], readonly=True) as blob:
                blob.seek(start)
                return blob.read(size)

    def _part(self, file_id: str, n: int) -> bytes | None:
        with closing(self._connect()) as db:
            row = db.execute(
                "SELECT data FROM file_parts WHERE file_id = ? AND n = ?", (file_id, n)
            ).fetchone()
        return None if row is None else row[0]

    def files(
        self, tenant: str | None, purpose: str | None, after: str | None, limit: int
    ) -> Page[StoredFile]:
        with closing(self._connect()) as db:
            rows = db.execute(
                f"SELECT id, purpose, filename, created, {_SIZE} FROM files WHERE "
                f"tenant IS ? AND (? IS NULL OR purpose = ?) AND {_AFTER.format(table='files')} "
                "ORDER BY created DESC, id DESC LIMIT ?",
                (tenant, purpose, purpose, after, after, tenant, limit + 1),
            ).fetchall()
        return page([StoredFile(*r) for r in rows], limit)

    def delete_file(self, file_id: str, tenant: str | None) -> bool:
        """Drop the tenant's file and the pieces it was uploaded in, on a full disk too."""

        def drop(db: sqlite3.Connection) -> int:
            gone = db.execute("DELETE FROM files WHERE id = ? AND tenant IS ?", (file_id, tenant))
            if gone.rowcount == 1:
                db.execute("DELETE FROM file_parts WHERE file_id = ?", (file_id,))
            return gone.rowcount

        return self._freeing(drop) == 1


class _Open(NamedTuple):
    """A batch about to end, in the transaction `db` holds: its state and tenant."""

    db: sqlite3.Connection
    status: str
    tenant: str | None


class SqliteBatches(BatchesLogic[_Open], SqliteDb):
    """The batches table; a batch's lines are rows of the jobs table until it ends."""

    def put_batch(self, batch: Batch, tenant: str | None, lines: Sequence[Line]) -> None:
        """Accept a batch and its lines as jobs, in one transaction."""
        self._room()
        with self._transaction() as db:
            db.execute(
                f"INSERT INTO batches (tenant, {_BATCH}) VALUES ({', '.join('?' * 18)})",
                (tenant, *batch),
            )
            now = batch.created
            db.executemany(
                "INSERT INTO jobs (id, tenant, path, body, status, created, updated, "
                "batch_id, line, custom_id) VALUES (?, ?, ?, ?, 'queued', ?, ?, ?, ?, ?)",
                [
                    (ln.id, tenant, ln.path, ln.body, now, now, batch.id, n, ln.custom_id)
                    for n, ln in enumerate(lines)
                ],
            )

    def batch(self, batch_id: str, tenant: str | None) -> Batch | None:
        """The batch, with its counts so far while it runs."""
        with closing(self._connect()) as db:
            row = db.execute(
                f"SELECT {_BATCH} FROM batches WHERE id = ? AND tenant IS ?", (batch_id, tenant)
            ).fetchone()
            return None if row is None else _counted(db, Batch(*row))

    def batches(self, tenant: str | None, after: str | None, limit: int) -> Page[Batch]:
        with closing(self._connect()) as db:
            rows = db.execute(
                f"SELECT {_BATCH} FROM batches WHERE tenant IS ? AND "
                f"{_AFTER.format(table='batches')} ORDER BY created DESC, id DESC LIMIT ?",
                (tenant, after, after, tenant, limit + 1),
            ).fetchall()
            return page([_counted(db, Batch(*r)) for r in rows], limit)

    def unsettled(self) -> list[str]:
        """The open batches none of whose lines waits or runs."""
        with closing(self._connect()) as db:
            rows = db.execute(
                "SELECT id FROM batches WHERE status IN (?, ?) AND NOT EXISTS "
                "(SELECT 1 FROM jobs WHERE batch_id = batches.id "
                "AND status IN ('queued', 'running'))",
                OPEN_BATCH,
            ).fetchall()
        return [r[0] for r in rows]

    def _cancel(self, batch_id: str, tenant: str | None, now: float) -> bool:
        with self._transaction() as db:
            moved = db.execute(
                "UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? "
                "AND tenant IS ? AND status = 'in_progress'",
                (now, batch_id, tenant),
            ).rowcount
            if moved:
                db.execute(
                    "UPDATE jobs SET status = 'cancelled' WHERE batch_id = ? AND status = 'queued'",
                    (batch_id,),
                )
        return moved == 1

    @contextmanager
    def _ending(self, batch_id: str) -> Iterator[Ending[_Open] | None]:
        """In one transaction, which `_end` ends the batch in."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT status, tenant FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()
            if row is None or row[0] not in OPEN_BATCH or _runs(db, batch_id):
                yield None
                return
            outcomes = [
                Outcome(*r)
                for r in db.execute(
                    "SELECT id, custom_id, result_status, result FROM jobs WHERE "
                    "batch_id = ? AND status IN ('succeeded', 'failed') ORDER BY line",
                    (batch_id,),
                )
            ]
            yield Ending(outcomes, _Open(db, *row))

    def _end(
        self, batch_id: str, ending: Ending[_Open], outputs: Outputs, now: float, ttl_s: float
    ) -> bool:
        db, status, tenant = ending.handle
        ids = _write_outputs(db, tenant, outputs, now + ttl_s)
        done = sum(1 for o in ending.outcomes if o.status < 400)
        db.execute(
            "UPDATE batches SET status = ?, completed = ?, failed = ?, output_file_id = ?, "
            "error_file_id = ?, finished_at = ?, expires = ? WHERE id = ?",
            (
                "cancelled" if status == "cancelling" else "completed",
                done,
                len(ending.outcomes) - done,
                *ids,
                now,
                now + ttl_s,
                batch_id,
            ),
        )
        db.execute("DELETE FROM jobs WHERE batch_id = ?", (batch_id,))
        return True


class SqliteJobStore(SqliteJobs, SqliteFiles, SqliteBatches):
    """The database at `path` (SqliteDb), with its jobs, files and batches; a database
    deleted while the router runs is created anew at the next call (what it held is
    lost, the router goes on)."""


def _write_outputs(
    db: sqlite3.Connection,
    tenant: str | None,
    outputs: Outputs,
    expires: float,
) -> tuple[str | None, str | None]:
    """A batch's output and error files, each only if it has a line."""
    written: list[str | None] = []
    for file_id, content, purpose in zip(*outputs, ("output", "error"), strict=True):
        if not content:
            written.append(None)
            continue
        db.execute(
            _ADD_FILE,
            (
                file_id,
                tenant,
                "batch_output",
                f"batch_{purpose}.jsonl",
                time.time(),
                content,
                expires,
            ),
        )
        written.append(file_id)
    return written[0], written[1]


def _runs(db: sqlite3.Connection, batch_id: str) -> bool:
    """Whether a line of the batch waits or runs."""
    return bool(
        db.execute(
            "SELECT 1 FROM jobs WHERE batch_id = ? AND status IN ('queued', 'running') LIMIT 1",
            (batch_id,),
        ).fetchone()
    )


def _counted(db: sqlite3.Connection, batch: Batch) -> Batch:
    """`batch` with its lines' counts so far, while it runs."""
    if batch.status not in OPEN_BATCH:
        return batch
    counts = dict(
        db.execute(
            "SELECT status, count(*) FROM jobs WHERE batch_id = ? GROUP BY status", (batch.id,)
        ).fetchall()
    )
    return batch._replace(completed=counts.get("succeeded", 0), failed=counts.get("failed", 0))
