"""The job store on one host: an embedded SQLite database in WAL mode, shared by every
worker (SQLite serialises the writers with its file lock). Leases, attempts and TTLs as
store.py says; expired rows are deleted by `expire`, which each worker calls now and
then.

A full disk must not stop the deletes that would free it: a database in WAL mode needs
room even to delete. So a file beside the database (`<path>.reserve`,
`_RESERVE_BYTES`) holds room back: a delete that meets a full disk gives it up and
goes through, and the database, made with incremental auto-vacuum, gives the freed
pages back to the filesystem. A client's write (a job, a file, a batch) is refused as
"disk full" while the reserve cannot be made again, so clients never take its room.
Deleted rows are not overwritten (`secure_delete=FAST`): that would need as much room
as they took. A database made by an older release (no auto-vacuum) keeps the freed
pages for its next rows instead, and its clients' writes are not held back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from pathlib import Path
from typing import TypeVar

from router import log
from router.config import ConfigError
from router.jobs.store import (
    OPEN_BATCH,
    Batch,
    FilePieces,
    Job,
    Layout,
    Line,
    Outcome,
    Page,
    StoredFile,
    Writer,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    tenant TEXT,
    path TEXT NOT NULL,
    body BLOB NOT NULL,
    status TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    owner TEXT,
    lease_until REAL NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    result_status INTEGER,
    result BLOB,
    expires REAL,
    batch_id TEXT,
    line INTEGER,
    custom_id TEXT,
    webhook TEXT,
    hook_state TEXT,
    hook_attempts INTEGER NOT NULL DEFAULT 0,
    hook_due REAL NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_waiting ON jobs (status, created);
CREATE INDEX IF NOT EXISTS jobs_of_batch ON jobs (batch_id, line);
CREATE INDEX IF NOT EXISTS jobs_hooks ON jobs (hook_state, hook_due);
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    tenant TEXT,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    created REAL NOT NULL,
    content BLOB NOT NULL,
    expires REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS file_parts (
    file_id TEXT NOT NULL,
    n INTEGER NOT NULL,
    tenant TEXT,
    data BLOB NOT NULL,
    expires REAL NOT NULL,
    PRIMARY KEY (file_id, n)
);
CREATE INDEX IF NOT EXISTS file_parts_of_tenant ON file_parts (tenant, expires);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    tenant TEXT,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata BLOB,
    status TEXT NOT NULL,
    errors BLOB,
    total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    output_file_id TEXT,
    error_file_id TEXT,
    created REAL NOT NULL,
    in_progress_at REAL,
    cancelling_at REAL,
    finished_at REAL,
    expires REAL
);
"""
_BUSY_SECONDS = 10.0
#: room held back on the database's filesystem for deletes on a full disk
_RESERVE_BYTES = 1 << 20
#: pages given back to the filesystem per step after a delete (each step's moves pass
#: through the WAL, so each needs at most this much room)
_GIVE_BACK_PAGES = 64
T = TypeVar("T")
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
#: SQLite's error codes (their names' beginnings), as a client may read them
_REASONS = (
    ("SQLITE_FULL", "its disk is full"),
    ("SQLITE_BUSY", "its database is locked by another process"),
    ("SQLITE_LOCKED", "its database is locked by another process"),
    ("SQLITE_CORRUPT", "its database is corrupt"),
    ("SQLITE_NOTADB", "its database is corrupt"),
    ("SQLITE_READONLY", "its database is read-only"),
    ("SQLITE_CANTOPEN", "its database cannot be opened"),
    ("SQLITE_IOERR", "its disk failed"),
)
#: a file's size: what it holds, and the pieces it was uploaded in
_SIZE = (
    "length(content) + "
    "(SELECT coalesce(sum(length(data)), 0) FROM file_parts WHERE file_id = files.id)"
)


class SqliteJobStore(FilePieces):
    """The database at `path`; a database deleted while the router runs is created
    anew at the next call (what it held is lost, the router goes on)."""

    errors: tuple[type[Exception], ...] = (sqlite3.Error, OSError)

    def __init__(self, path: str) -> None:
        """Create the database if need be (ConfigError if it cannot be)."""
        self._path = path
        self._opened = False
        self._reserve = _Reserve(path + ".reserve")
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with closing(self._connect()) as db:
                #: whether deletes give room back to the filesystem (auto-vacuum)
                self._gives_back = db.execute("PRAGMA auto_vacuum").fetchone()[0] != 0
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(f"jobs.path: cannot open {path}: {exc}") from exc
        self._opened = True
        with contextlib.suppress(OSError):  # none yet: the first client's write says why
            self._reserve.keep()

    def _connect(self) -> sqlite3.Connection:
        """A connection to the database, created with its schema where there is none
        (its directory too, if that was removed)."""
        try:
            db = sqlite3.connect(self._path, timeout=_BUSY_SECONDS, isolation_level=None)
        except sqlite3.OperationalError:
            Path(self._path).parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self._path, timeout=_BUSY_SECONDS, isolation_level=None)
        try:
            db.execute("PRAGMA secure_delete = FAST")
            if db.execute("PRAGMA schema_version").fetchone()[0] == 0:
                self._create(db)
        except BaseException:
            db.close()
            raise
        return db

    def _create(self, db: sqlite3.Connection) -> None:
        """The schema in an empty database, in one transaction: another connection
        creating it too, or reading it, sees every table or none."""
        if self._opened:
            log.server.warning("jobs: %s was gone; created anew, empty", self._path)
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")  # before anything is written
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} COMMIT;")  # all tables, or none yet
        self._gives_back = db.execute("PRAGMA auto_vacuum").fetchone()[0] != 0

    def reason(self, exc: Exception) -> str:
        """What failed, from SQLite's error code."""
        name = getattr(exc, "sqlite_errorname", "")
        if isinstance(exc, OSError):
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            return "its disk is full" if full else "its disk failed"
        for prefix, reason in _REASONS:
            if name.startswith(prefix):
                return reason
        return f"its database failed ({name or type(exc).__name__})"

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken at once (no lock upgrade to deadlock on)."""
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _room(self) -> None:
        """Before a client's write: the reserve in place (OSError, the disk full, if it
        cannot be made again)."""
        try:
            self._reserve.keep()
        except OSError:
            if self._gives_back:
                raise

    def _freeing(self, delete: Callable[[sqlite3.Connection], T]) -> T:
        """`delete` in one transaction, through a full disk (the reserve's room is given
        up for it); then the freed pages go back to the filesystem."""
        try:
            with self._transaction() as db:
                done = delete(db)
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", None) != sqlite3.SQLITE_FULL:
                raise
            if not self._reserve.give_up():
                raise
            log.server.warning(
                "jobs: %s: the disk is full; its reserve let a delete in", self._path
            )
            with self._transaction() as db:
                done = delete(db)
        self._give_back()
        return done

    def _give_back(self) -> None:
        """The free pages back to the filesystem, a few at a time (best effort: what
        stays is used by the next rows), then the reserve made again if there is room."""
        with contextlib.suppress(sqlite3.Error), closing(self._connect()) as db:
            free = db.execute("PRAGMA freelist_count").fetchone()[0]
            while free:
                db.execute(f"PRAGMA incremental_vacuum({_GIVE_BACK_PAGES})").fetchall()
                db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                left = db.execute("PRAGMA freelist_count").fetchone()[0]
                if left >= free:
                    break  # an older database (no auto-vacuum), or readers hold pages
                free = left
        with contextlib.suppress(OSError):  # no room yet: the next delete may make some
            self._reserve.keep()

    # jobs
    def put(
        self, job_id: str, tenant: str | None, path: str, body: bytes, webhook: str | None = None
    ) -> Job:
        """Accept a job: committed before this returns."""
        self._room()
        now = time.time()
        with closing(self._connect()) as db:
            db.execute(
                "INSERT INTO jobs (id, tenant, path, body, status, created, updated, webhook) "
                "VALUES (?, ?, ?, ?, 'queued', ?, ?, ?)",
                (job_id, tenant, path, body, now, now, webhook),
            )
        return Job(job_id, tenant, path, body, "queued", now, now, 0, None, None, None, webhook)

    def get(self, job_id: str, tenant: str | None) -> Job | None:
        """The async job, if it is `tenant`'s (another tenant's is as good as absent)."""
        with closing(self._connect()) as db:
            row = db.execute(
                f"SELECT {_JOB} FROM jobs WHERE id = ? AND tenant IS ? AND batch_id IS NULL",
                (job_id, tenant),
            ).fetchone()
        return None if row is None else Job(*row)

    def claim(self, owner: str, lease_s: float) -> Job | None:
        """The oldest job waiting (single async jobs before batch lines), or running
        under a lease that ran out, now leased to `owner` with one more attempt."""
        now = time.time()
        with closing(self._connect()) as db:
            row = db.execute(
                "UPDATE jobs SET status = 'running', owner = ?, lease_until = ?, "
                "attempts = attempts + 1, updated = ? WHERE id = (SELECT id FROM jobs "
                "WHERE status = 'queued' OR (status = 'running' AND lease_until < ?) "
                f"ORDER BY batch_id IS NOT NULL, created, line LIMIT 1) RETURNING {_JOB}",
                (owner, now + lease_s, now, now),
            ).fetchone()
        return None if row is None else Job(*row)

    def renew(self, job_id: str, owner: str, lease_s: float) -> bool:
        """Extend `owner`'s lease; False if it lost the job (its lease ran out)."""
        with closing(self._connect()) as db:
            done = db.execute(
                "UPDATE jobs SET lease_until = ? WHERE id = ? AND owner = ? AND status = 'running'",
                (time.time() + lease_s, job_id, owner),
            )
        return done.rowcount == 1

    def finish(
        self, job_id: str, owner: str, status: str, code: int, result: bytes, ttl_s: float
    ) -> bool:
        """Record the job's result, if `owner` still holds it (False if not); its
        webhook, if it has one, is due now."""
        now = time.time()
        with closing(self._connect()) as db:
            done = db.execute(
                "UPDATE jobs SET status = ?, result_status = ?, result = ?, updated = ?, "
                "expires = CASE WHEN batch_id IS NULL THEN ? END, owner = NULL, "
                "hook_state = CASE WHEN webhook IS NULL THEN NULL "
                "ELSE 'pending' END WHERE id = ? AND owner = ? AND status = 'running'",
                (status, code, result, now, now + ttl_s, job_id, owner),
            )
        return done.rowcount == 1

    def due_hook(self, lease_s: float) -> Job | None:
        """A finished job whose webhook is due, leased for `lease_s` (a worker that dies
        delivering leaves it due again then)."""
        now = time.time()
        with closing(self._connect()) as db:
            row = db.execute(
                "UPDATE jobs SET hook_due = ? WHERE id = (SELECT id FROM jobs WHERE "
                "hook_state = 'pending' AND hook_due <= ? ORDER BY hook_due LIMIT 1) "
                f"RETURNING {_JOB}",
                (now + lease_s, now),
            ).fetchone()
        return None if row is None else Job(*row)

    def hook_tried(self, job_id: str, state: str, retry_in: float) -> None:
        """One delivery attempt made: now `state` ("pending" to retry in `retry_in`)."""
        with closing(self._connect()) as db:
            db.execute(
                "UPDATE jobs SET hook_state = ?, hook_attempts = hook_attempts + 1, "
                "hook_due = ? WHERE id = ?",
                (state, time.time() + retry_in, job_id),
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

    # files
    def put_file(
        self,
        file_id: str,
        tenant: str | None,
        purpose: str,
        filename: str,
        content: bytes,
        ttl_s: float,
    ) -> StoredFile:
        self._room()
        now = time.time()
        with closing(self._connect()) as db:
            db.execute(
                "INSERT INTO files (id, tenant, purpose, filename, created, content, expires) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (file_id, tenant, purpose, filename, now, content, now + ttl_s),
            )
        return StoredFile(file_id, purpose, filename, now, len(content))

    def file(self, file_id: str, tenant: str | None) -> StoredFile | None:
        with closing(self._connect()) as db:
            row = db.execute(
                f"SELECT id, purpose, filename, created, {_SIZE} FROM files "
                "WHERE id = ? AND tenant IS ?",
                (file_id, tenant),
            ).fetchone()
        return None if row is None else StoredFile(*row)

    def put_part(
        self, file_id: str, tenant: str | None, n: int, data: bytes, ttl_s: float, quota: int
    ) -> bool:
        """Keep piece `n` of an upload (seen once `seal_file` ends it); False, keeping
        nothing, if the tenant's uploads would then pass `quota` bytes."""
        self._room()
        now = time.time()
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
                (file_id, n, tenant, data, now + ttl_s),
            )
        return True

    def seal_file(
        self, file_id: str, tenant: str | None, purpose: str, filename: str, ttl_s: float
    ) -> StoredFile:
        """The upload whose pieces `put_part` kept, now a file (they expire with it)."""
        now = time.time()
        with self._transaction() as db:
            db.execute(
                "INSERT INTO files (id, tenant, purpose, filename, created, content, expires) "
                "VALUES (?, ?, ?, ?, ?, x'', ?)",
                (file_id, tenant, purpose, filename, now, now + ttl_s),
            )
            db.execute(
                "UPDATE file_parts SET expires = ? WHERE file_id = ?", (now + ttl_s, file_id)
            )
            (size,) = db.execute(
                "SELECT coalesce(sum(length(data)), 0) FROM file_parts WHERE file_id = ?",
                (file_id,),
            ).fetchone()
        return StoredFile(file_id, purpose, filename, now, size)

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
        return Page([StoredFile(*r) for r in rows[:limit]], len(rows) > limit)

    def delete_file(self, file_id: str, tenant: str | None) -> bool:
        """Drop the tenant's file and the pieces it was uploaded in, on a full disk too."""

        def drop(db: sqlite3.Connection) -> int:
            gone = db.execute("DELETE FROM files WHERE id = ? AND tenant IS ?", (file_id, tenant))
            if gone.rowcount == 1:
                db.execute("DELETE FROM file_parts WHERE file_id = ?", (file_id,))
            return gone.rowcount

        return self._freeing(drop) == 1

    # batches
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
            return Page([_counted(db, Batch(*r)) for r in rows[:limit]], len(rows) > limit)

    def cancel_batch(self, batch_id: str, tenant: str | None) -> bool:
        """Stop a batch's waiting lines (those running finish); False if it had ended."""
        with self._transaction() as db:
            moved = db.execute(
                "UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? "
                "AND tenant IS ? AND status = 'in_progress'",
                (time.time(), batch_id, tenant),
            ).rowcount
            if moved:
                db.execute(
                    "UPDATE jobs SET status = 'cancelled' WHERE batch_id = ? AND status = 'queued'",
                    (batch_id,),
                )
        return moved == 1

    def settle(self, batch_id: str, files: tuple[str, str], write: Writer, ttl_s: float) -> bool:
        """End the batch if none of its lines waits or runs: its output and error files
        (ids `files`) from `write`, its counts and state, its lines dropped. True if
        this call ended it."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT status, tenant FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()
            if row is None or row[0] not in OPEN_BATCH:
                return False
            status, tenant = row
            if db.execute(
                "SELECT 1 FROM jobs WHERE batch_id = ? AND status IN ('queued', 'running') LIMIT 1",
                (batch_id,),
            ).fetchone():
                return False
            outcomes = [
                Outcome(*r)
                for r in db.execute(
                    "SELECT id, custom_id, result_status, result FROM jobs WHERE "
                    "batch_id = ? AND status IN ('succeeded', 'failed') ORDER BY line",
                    (batch_id,),
                )
            ]
            now = time.time()
            ids = self._write_outputs(db, tenant, files, write(outcomes), now + ttl_s)
            done = sum(1 for o in outcomes if o.status < 400)
            db.execute(
                "UPDATE batches SET status = ?, completed = ?, failed = ?, output_file_id = ?, "
                "error_file_id = ?, finished_at = ?, expires = ? WHERE id = ?",
                (
                    "cancelled" if status == "cancelling" else "completed",
                    done,
                    len(outcomes) - done,
                    *ids,
                    now,
                    now + ttl_s,
                    batch_id,
                ),
            )
            db.execute("DELETE FROM jobs WHERE batch_id = ?", (batch_id,))
        return True

    @staticmethod
    def _write_outputs(
        db: sqlite3.Connection,
        tenant: str | None,
        ids: tuple[str, str],
        contents: tuple[bytes, bytes],
        expires: float,
    ) -> tuple[str | None, str | None]:
        """The output and error files, each only if it has a line."""
        written: list[str | None] = []
        for file_id, content, purpose in zip(ids, contents, ("output", "error"), strict=True):
            if not content:
                written.append(None)
                continue
            db.execute(
                "INSERT INTO files (id, tenant, purpose, filename, created, content, expires) "
                "VALUES (?, ?, 'batch_output', ?, ?, ?, ?)",
                (file_id, tenant, f"batch_{purpose}.jsonl", time.time(), content, expires),
            )
            written.append(file_id)
        return written[0], written[1]


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


class _Reserve:
    """Room held back on a filesystem: a file of `_RESERVE_BYTES` (every worker's
    store shares it)."""

    def __init__(self, path: str) -> None:
        self._path = path

    def keep(self) -> None:
        """The reserve in place, made again if it is not (OSError if it cannot be: no
        room, most likely)."""
        if os.path.exists(self._path):
            return
        making = f"{self._path}.{os.getpid()}"
        try:
            fd = os.open(making, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, _RESERVE_BYTES)
            finally:
                os.close(fd)
            os.replace(making, self._path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(making)
            raise

    def give_up(self) -> bool:
        """Its room, for a delete on a full disk: whether there was a reserve."""
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            return False
        return True
