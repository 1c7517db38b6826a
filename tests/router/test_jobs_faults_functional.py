"""The jobs under real store faults: a SQLite database locked by another process,
deleted, corrupted or on a full filesystem, and a real redis-server stopped and started
again. The router answers 503s that say why, its job runner waits and goes on, its
/ready stays 200 and says what failed, and SIGTERM still drains the streams."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
import yaml

from router.config import RedisConfig
from router.jobs import sqlite_db
from router.jobs.redis_store import RedisJobStore
from router.jobs.sqlite_store import SqliteJobStore
from router.jobs.store import JobStore
from router.jobs.wire import new_batch
from tests.redis_server import RedisServer
from tests.router.chaos import Tally, chat, until
from tests.router.conftest import running
from tests.router.test_jobs_functional import (
    CHAT,
    batch_file,
    chat_body,
    finished,
    jobs_router,
    wait_batch,
)
from tests.router.test_jobs_store import lines_of
from tests.router.test_signals_functional import CHAT_PATH, kvroute
from tests.stub_backend import StubBackend
from tests.tmpfs import small_disk


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
    monkeypatch.setattr(sqlite_db, "_BUSY_SECONDS", 0.2)  # the wait before SQLITE_BUSY
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


def corrupt(db: Path) -> None:
    """Garbage where the database's pages were (its header included)."""
    for leftover in (db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        leftover.unlink(missing_ok=True)
    db.write_bytes(b"not a database, " * 4096)


@pytest.mark.parametrize("fault", ["sqlite-corrupt", "redis-stopped"])
async def test_sigterm_drains_the_streams_whatever_the_job_store_does(
    tmp_path: Path, fault: str
) -> None:
    """The jobs' stop meets a store that fails; the streams open still end whole, and
    the router exits 0."""
    stub = await StubBackend().start()
    stub.behaviour.chunks, stub.behaviour.pace = 10, 0.1  # ~1 s streams
    redis = RedisServer(tmp_path) if fault == "redis-stopped" else None
    jobs = {"enabled": True, "path": str(tmp_path / "jobs.db"), "poll_s": 0.05}
    if redis is not None:
        redis.start()
        jobs |= {"store": "redis", "redis": {"url": redis.url}}
    path = tmp_path / "router.yaml"
    backends = [{"url": stub.url, "name": "s0"}]
    path.write_text(
        yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0}, "backends": backends,
                        "jobs": jobs, "shutdown": {"drain_seconds": 10}})
    )  # fmt: skip
    tally = Tally.new()
    try:
        async with kvroute(path) as served, aiohttp.ClientSession() as http:
            url = served.url + CHAT_PATH
            streams = [
                asyncio.create_task(tally.send(http, url, **chat(stream=True))) for _ in range(5)
            ]
            await until(lambda: stub.active == 5)
            if redis is not None:
                redis.stop()
            else:
                corrupt(tmp_path / "jobs.db")
            served.proc.send_signal(signal.SIGTERM)
            replies = await asyncio.gather(*streams)
            assert await asyncio.wait_for(served.proc.wait(), 15) == 0, served.log.decode()
        for reply in replies:
            assert reply.status == 200
            assert reply.events()[-1] == b"[DONE]" and b'"error"' not in reply.body
            assert len(reply.events()) == 11  # every chunk, then [DONE]
        assert (tally.failed, tally.hung) == (0, 0)
    finally:
        if redis is not None:
            redis.stop()
        await stub.stop()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_a_batch_whose_settle_was_missed_is_ended_by_a_sweep(
    tmp_path: Path, kind: str
) -> None:
    """Its worker died between its last line's end and the batch's: the next worker
    that looks for a job ends it."""
    jobs = {"enabled": True, "path": str(tmp_path / "jobs.db"), "poll_s": 0.05, "lease_s": 0.5}
    redis = RedisServer(tmp_path) if kind == "redis" else None
    try:
        if redis is not None:
            redis.start()
            jobs |= {"store": "redis", "redis": {"url": redis.url}}
            store: JobStore = RedisJobStore(RedisConfig(url=redis.url))
        else:
            store = SqliteJobStore(jobs["path"])
        batch = new_batch("/v1/chat/completions", "file-1", None, 2, [], 60)
        store.put_batch(batch, None, lines_of(2))
        for _ in range(2):
            line = store.claim("dead-worker", 60)
            store.finish(line.id, "dead-worker", "succeeded", 200, b'{"ok":1}', 60)
        async with jobs_router(tmp_path, jobs=jobs) as (_, oai):
            done = await wait_batch(oai, batch.id)
            assert (done.status, done.request_counts.completed) == ("completed", 2)
            output = (await oai.files.content(done.output_file_id)).content
            assert output.count(b"\n") == 2
    finally:
        if redis is not None:
            redis.stop()


async def _past_locked(call, url: str, **kwargs) -> aiohttp.ClientResponse:
    """The first answer that is not a 503: while the runner creates the database anew,
    another connection may find it locked for a moment."""
    async with asyncio.timeout(10):
        while True:
            r = await call(url, **kwargs)
            await r.read()
            if r.status != 503:
                return r
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("removed", ["files", "directory"])
async def test_a_deleted_database_is_created_anew(tmp_path: Path, removed: str) -> None:
    where = tmp_path / "jobs"
    jobs = {"enabled": True, "path": str(where / "jobs.db"), "poll_s": 0.05}
    async with (
        jobs_router(tmp_path, jobs=jobs) as (router, oai),
        aiohttp.ClientSession() as http,
    ):
        uploaded = await oai.files.create(
            file=("in.jsonl", io.BytesIO(batch_file(1))), purpose="batch"
        )
        if removed == "directory":
            for _ in range(50):  # its files may come and go as the runner connects
                shutil.rmtree(where, ignore_errors=True)
                if not where.exists():
                    break
            assert not where.exists()
        else:
            for name in ("jobs.db", "jobs.db-wal", "jobs.db-shm"):
                (where / name).unlink(missing_ok=True)
        r = await _past_locked(http.get, router.url + f"/v1/files/{uploaded.id}")
        assert r.status == 404  # gone with its database
        r = await _past_locked(http.post, router.url + CHAT, json=chat_body(1))
        assert r.status == 202
        status_url = router.url + (await r.json())["status_url"]
        assert (await finished(http, status_url))["status"] == "succeeded"


async def test_a_corrupt_database_answers_503s_and_logs_a_few_lines(tmp_path: Path, caplog) -> None:
    """Every job route says why it fails, with no traceback and a throttled log; once
    the file is moved aside, a new one is created and jobs run again."""
    async with jobs_router(tmp_path) as (router, _), aiohttp.ClientSession() as http:
        caplog.set_level(logging.WARNING)
        corrupt(tmp_path / "jobs.db")
        for _ in range(50):
            await refused_for(http, router.url, "its database is corrupt")
        for method, path in (("GET", "/v1/files"), ("DELETE", "/v1/files/file-x"),
                             ("GET", "/v1/batches"), ("GET", "/v1/async/job_x")):  # fmt: skip
            async with http.request(method, router.url + path) as r:
                assert r.status == 503, path
        failures = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert not [r for r in failures if r.exc_info]
        assert len(failures) <= 6, [r.getMessage() for r in failures]
        (tmp_path / "jobs.db").rename(tmp_path / "jobs.db.corrupt")
        async with http.post(router.url + CHAT, json=chat_body(1)) as r:
            assert r.status == 202
            status_url = router.url + (await r.json())["status_url"]
        assert (await finished(http, status_url))["status"] == "succeeded"


async def upload(http: aiohttp.ClientSession, url: str, size: int) -> tuple[int, dict, str]:
    """A file of `size` bytes: the answer's status, body and Retry-After."""
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", b"x" * size, filename="in.jsonl")
    async with http.post(url + "/v1/files", data=form) as r:
        return r.status, await r.json(), r.headers.get("Retry-After", "")


async def test_on_a_full_disk_files_can_still_be_deleted_to_make_room(
    tmp_path: Path, caplog
) -> None:
    """Uploads fill a small filesystem: then they are refused with a 503 that says so,
    deletes go through, and give the room back for the next uploads."""
    with small_disk(tmp_path / "disk", "8m") as disk:
        jobs = {"enabled": True, "path": str(disk / "jobs.db"), "poll_s": 0.05}
        async with jobs_router(tmp_path, jobs=jobs) as (router, _), aiohttp.ClientSession() as http:
            caplog.set_level(logging.WARNING)
            ids = []
            for _ in range(40):  # 16 MB: twice the disk
                status, answer, retry_after = await upload(http, router.url, 400_000)
                if status != 200:
                    break
                ids.append(answer["id"])
            assert status == 503, answer
            assert "its disk is full" in answer["error"]["message"]
            assert retry_after == "5"
            assert len(ids) > 5
            for file_id in ids[:3]:
                async with http.delete(router.url + f"/v1/files/{file_id}") as gone:
                    assert gone.status == 200, await gone.text()
                    assert (await gone.json())["deleted"] is True
            assert (await upload(http, router.url, 400_000))[0] == 200
            for _ in range(30):  # full again, and deletes still go through
                if (await upload(http, router.url, 400_000))[0] == 503:
                    break
            async with http.delete(router.url + f"/v1/files/{ids[3]}") as gone:
                assert gone.status == 200, await gone.text()
            warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(warnings) <= 10, [r.getMessage() for r in warnings]


def fill(disk: Path) -> None:
    """Every byte of `disk` taken, by a file of its own."""
    with (disk / "filler").open("wb", buffering=0) as filler, contextlib.suppress(OSError):
        while True:
            filler.write(b"\0" * 4096)


async def test_a_full_disk_is_logged_a_few_times_not_once_a_write(tmp_path: Path, caplog) -> None:
    """The access log on a disk that filled up: its lost writes are logged throttled."""
    with small_disk(tmp_path / "disk", "1m") as disk:
        log_file = {"path": str(disk / "access.log")}
        async with running(1, access_log=log_file) as (router, _), aiohttp.ClientSession() as http:
            fill(disk)
            caplog.set_level(logging.WARNING)
            for _ in range(40):  # a write each (its flush timer is 0.2 s)
                async with http.post(router.url + CHAT_PATH, **chat()) as r:
                    assert r.status == 200
                await asyncio.sleep(0.21)
        # the router stopped: its access log's writer wrote (or lost) every line
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("cannot write" in w for w in warnings)
        assert len(warnings) <= 21, warnings[:5]
