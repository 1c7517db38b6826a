"""The SQLite job store's database: one file in WAL mode that every worker on the host
shares (SQLite serialises the writers with its file lock), its schema, its connections
and transactions, and what a failure of it is called. sqlite_store.py keeps the jobs,
files and batches in it.

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
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import TypeVar

from router import log
from router.config import ConfigError

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


class SqliteDb:
    """The database at `path`, created if need be; one deleted while the router runs is
    created anew at the next call (what it held is lost, the router goes on)."""

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
