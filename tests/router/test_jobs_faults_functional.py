"""The jobs under real store faults: a SQLite database locked by another process,
deleted, corrupted or on a full filesystem, and a real redis-server stopped and started
again. The router answers 503s that say why, its job runner waits and goes on, its
/ready stays 200 and says what failed, and SIGTERM still drains the streams."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from router.jobs import sqlite_store
from tests.redis_server import RedisServer
from tests.router.chaos import until
from tests.router.test_jobs_functional import (
    CHAT,
    chat_body,
    finished,
    jobs_router,
)


@asynccontextmanager
async def locked(db: Path) -> AsyncIterator[None]:
    """Another process holds the database's write lock (`BEGIN EXCLUSIVE`) meanwhile."""
    script = (
        "import sqlite3, sys\n"
        "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "db.execute('BEGIN EXCLUSIVE')\n"
        "print('locked', flush=True)\n"
        "sys.stdin.readline()\n"
        "db.execute('ROLLBACK')\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, str(db),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 10) == b"locked\n"
        yield
    finally:
        proc.stdin.write(b"\n")
        await proc.stdin.drain()
        await asyncio.wait_for(proc.wait(), 10)


async def refused_for(http: aiohttp.ClientSession, url: str, reason: str) -> None:
    """A job offered now is refused with a 503 that says `reason`, and Retry-After."""
    async with http.post(url + CHAT, json=chat_body(0)) as r:
        assert r.status == 503, await r.text()
        assert r.headers["Retry-After"] == "5"
        error = (await r.json())["error"]
    assert error["type"] == "ServiceUnavailableError"
    assert reason in error["message"]


async def ready(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/ready") as r:
        assert r.status == 200  # interactive requests need no job store
        return await r.json()


async def test_the_runner_outlives_a_database_locked_by_another_process(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(sqlite_store, "_BUSY_SECONDS", 0.2)  # the wait before SQLITE_BUSY
    async with jobs_router(tmp_path) as (router, _), aiohttp.ClientSession() as http:
        sample = router.metrics.registry.get_sample_value
        async with locked(tmp_path / "jobs.db"):
            await until(lambda: sample("kvroute_job_store_errors_total", {"op": "claim"}) >= 2)
            await refused_for(http, router.url, "locked by another process")
            assert sample("kvroute_job_store_errors_total", {"op": "put"}) == 1
            jobs = (await ready(http, router.url))["jobs"]
            assert (jobs["store"], jobs["reason"]) == (
                "unavailable",
                "its database is locked by another process",
            )
            assert sample("kvroute_job_store_unavailable") == 1
        async with http.post(router.url + CHAT, json=chat_body(1)) as r:
            assert r.status == 202
            status_url = router.url + (await r.json())["status_url"]
        assert (await finished(http, status_url))["status"] == "succeeded"
        assert (await ready(http, router.url))["jobs"] == {"store": "ok"}
        assert sample("kvroute_job_store_unavailable") == 0


async def test_the_runner_outlives_a_redis_stopped_and_started_again(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        jobs = {"enabled": True, "store": "redis", "redis": {"url": server.url}, "poll_s": 0.05}
        async with jobs_router(tmp_path, jobs=jobs) as (router, _), aiohttp.ClientSession() as http:
            sample = router.metrics.registry.get_sample_value
            server.stop()
            await until(lambda: sample("kvroute_job_store_errors_total", {"op": "claim"}) >= 2)
            await refused_for(http, router.url, "Redis does not answer")
            jobs = (await ready(http, router.url))["jobs"]
            assert (jobs["store"], jobs["reason"]) == ("unavailable", "Redis does not answer")
            server.start()
            async with http.post(router.url + CHAT, json=chat_body(1)) as r:
                assert r.status == 202
                status_url = router.url + (await r.json())["status_url"]
            assert (await finished(http, status_url))["status"] == "succeeded"
            assert (await ready(http, router.url))["jobs"] == {"store": "ok"}
    finally:
        server.stop()
