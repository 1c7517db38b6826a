"""Usage records for chargeback: each worker's token counts by tenant, model and pool,
summed over a window and written to a SQLite database every `interval_s`.

The same counts as `kvroute_tokens_total` and `kvroute_usage_requests_total` (one set of
counters, two views): the metrics for dashboards, these rows for "what did tenant T use
from Monday to Friday" (`GET /admin/usage`). The metrics bound their tenant label (an
unlisted tenant is `(other)`); these rows keep every tenant's id, already validated by
auth, since a bill needs it and a database row costs no series. A request adds to a
dict in memory; the window's rows are written in a thread, never on the loop. Every
worker writes its own rows (its pid in them) to the one database, in WAL mode with a
busy timeout, so workers and the admin API's reader do not block each other. The rows
are summed when read.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

from router import log
from router.config import ConfigError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    window_start REAL NOT NULL,
    window_end REAL NOT NULL,
    pid INTEGER NOT NULL,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    pool TEXT NOT NULL,
    requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_by_time ON usage (window_start);
"""
#: how long a writer or reader waits for another's lock, seconds
_BUSY_SECONDS = 10.0

#: (tenant, model, pool) -> [requests, prompt, cached, completion]
Window = dict[tuple[str, str, str], list[int]]


class UsageRecords:
    """One worker's current window and the database its closed windows go to."""

    def __init__(self, path: str, interval: float, clock: Callable[[], float] = time.time) -> None:
        """Create the database if need be (ConfigError if it cannot be)."""
        self._path = path
        self._interval = interval
        self._clock = clock
        self._window: Window = {}
        self._started = clock()
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with closing(_connect(path)) as db:
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(f"usage.path: cannot open {path}: {exc}") from exc

    def add(
        self,
        tenant: str,
        model: str,
        pool: str,
        prompt: int | None,
        cached: int | None,
        completion: int | None,
    ) -> None:
        """Count one answer's usage in the current window (no I/O)."""
        row = self._window.get((tenant, model, pool))
        if row is None:
            row = self._window[(tenant, model, pool)] = [0, 0, 0, 0]
        row[0] += 1
        row[1] += prompt or 0
        row[2] += cached or 0
        row[3] += completion or 0

    async def run(self) -> None:
        """Close the window every `interval` seconds and write it."""
        while True:
            await asyncio.sleep(self._interval)
            await self.flush()

    async def flush(self) -> None:
        """Write the current window's rows (in a thread) and begin the next window."""
        window, start, end = self._window, self._started, self._clock()
        self._window, self._started = {}, end
        if window:
            try:
                await asyncio.to_thread(_write, self._path, start, end, window)
            except sqlite3.Error as exc:
                log.disk_failed.warning("usage records: a window was lost: %s", exc)


def _connect(path: str) -> sqlite3.Connection:
    return sqlite3.connect(path, timeout=_BUSY_SECONDS)


def _write(path: str, start: float, end: float, window: Window) -> None:
    pid = os.getpid()
    rows = [(start, end, pid, *key, *counts) for key, counts in window.items()]
    with closing(_connect(path)) as db, db:
        db.executemany("INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)


def read(path: str, since: float, until: float, tenant: str | None = None) -> list[dict]:
    """The usage of the windows that began in [since, until), summed by tenant, model and
    pool (of `tenant` only, if given), with the span the windows covered. Blocking: call
    it in a thread."""
    query = (
        "SELECT tenant, model, pool, MIN(window_start), MAX(window_end), SUM(requests), "
        "SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens) FROM usage "
        "WHERE window_start >= ? AND window_start < ?"
    )
    args: list[object] = [since, until]
    if tenant is not None:
        query += " AND tenant = ?"
        args.append(tenant)
    query += " GROUP BY tenant, model, pool ORDER BY tenant, model, pool"
    keys = ("tenant", "model", "pool", "from", "to", "requests", "prompt_tokens")
    keys += ("cached_tokens", "completion_tokens")
    with closing(_connect(path)) as db:
        return [dict(zip(keys, row, strict=True)) for row in db.execute(query, args)]
