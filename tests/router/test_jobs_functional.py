"""Async jobs and OpenAI batches end to end: simulated vLLM servers, the router with
`jobs` on, the OpenAI SDK's files and batches calls, and a `kvroute serve` killed with
SIGKILL mid-job whose next start finishes it."""

from __future__ import annotations

import asyncio
import gc
import io
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, closing
from pathlib import Path

import aiohttp
import orjson
import psutil
import pytest
import redis
import yaml
from openai import AsyncOpenAI
from yarl import URL

from bench.sim.fleet import start_fleet
from bench.sim.params import SimParams
from router.config import JobsConfig, build
from router.control.worker import Router
from router.errors import BadRequest
from router.jobs.store import PIECE_BYTES
from router.jobs.webhooks import checked_webhook
from tests.redis_server import redis_server
from tests.router.chaos import until
from tests.router.test_signals_functional import kvroute
from tests.stub_backend import StubBackend

MODEL = "sim-llama-70b"
WEBHOOK = "X-Kvroute-Webhook"
CHAT = "/v1/async/chat/completions"


@asynccontextmanager
async def jobs_router(tmp_path: Path, **extra) -> AsyncIterator[tuple[Router, AsyncOpenAI]]:
    fleet = await start_fleet(2, SimParams(time_scale=0.02))
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": b.url, "name": f"sim{i}"} for i, b in enumerate(fleet.backends)],
        "jobs": {"enabled": True, "path": str(tmp_path / "jobs.db"), "poll_s": 0.05},
        "tenant_header": "X-Tenant",
        **extra,
    }
    router = Router(build(data))
    try:
        await router.start()
        async with AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as oai:
            yield router, oai
    finally:
        await router.stop()
        await fleet.stop()


def chat_body(i: int, **extra) -> dict:
    messages = [{"role": "user", "content": f"async request {i}"}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}


async def finished(http: aiohttp.ClientSession, url: str, headers=None) -> dict:
    """Poll a job's status URL (bounded) until it has its answer."""
    async with asyncio.timeout(20):
        while True:
            async with http.get(url, headers=headers) as r:
                assert r.status == 200, await r.text()
                job = await r.json()
            if job["status"] in ("succeeded", "failed"):
                return job
            await asyncio.sleep(0.05)


async def test_an_async_request_is_accepted_then_answered(tmp_path: Path) -> None:
    async with jobs_router(tmp_path) as (router, _), aiohttp.ClientSession() as http:
        async with http.post(router.url + CHAT, json=chat_body(1)) as r:
            assert r.status == 202
            accepted = await r.json()
            assert r.headers["Location"] == accepted["status_url"]
        assert accepted["object"] == "async.job"
        assert accepted["status"] == "queued"
        job = await finished(http, router.url + accepted["status_url"])
        assert job["status"] == "succeeded"
        assert job["attempts"] == 1
        answer = job["result"]["body"]
        assert job["result"]["status_code"] == 200
        sample = router.metrics.registry.get_sample_value
        assert sample("kvroute_jobs_accepted_total", {"kind": "async"}) == 1
        assert sample("kvroute_job_attempts_total") == 1
        assert sample("kvroute_jobs_ended_total", {"outcome": "succeeded"}) == 1
        assert answer["object"] == "chat.completion"
        assert answer["usage"]["completion_tokens"] == 4
        # another tenant's job is as good as absent
        url = router.url + accepted["status_url"]
        async with http.get(url, headers={"X-Tenant": "other"}) as r:
            assert r.status == 404
            assert "No async job" in (await r.json())["error"]["message"]


async def test_async_refusals_say_why_and_store_nothing(tmp_path: Path) -> None:
    async with jobs_router(tmp_path) as (router, _), aiohttp.ClientSession() as http:
        url = router.url + CHAT
        body = orjson.dumps(chat_body(1))
        pad = b" " * (128_001 - len(body))  # JSON whitespace: a valid body, one byte too big
        async with http.post(url, data=body[:-1] + pad + b"}") as r:
            assert r.status == 413
            assert "128000 bytes" in (await r.json())["error"]["message"]
        async with http.post(url, data=body[:-1] + pad[:-1] + b"}") as r:
            assert r.status == 202  # 128,000 bytes exactly
        async with http.post(url, json=chat_body(2, stream=True)) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "stream"
        async with http.post(url, data=b"{not json") as r:
            assert r.status == 400
        async with http.get(router.url + "/v1/async/job_nope") as r:
            assert r.status == 404


async def test_unknown_model_fails_the_job_with_the_routers_answer(tmp_path: Path) -> None:
    async with jobs_router(tmp_path) as (router, _), aiohttp.ClientSession() as http:
        body = {**chat_body(1), "model": "no-such-model"}
        async with http.post(router.url + CHAT, json=body) as r:
            accepted = await r.json()
        job = await finished(http, router.url + accepted["status_url"])
        assert job["status"] == "failed"
        assert job["result"]["status_code"] == 404
        assert "no-such-model" in job["result"]["body"]["error"]["message"]


def batch_file(n: int, endpoint: str = "/v1/chat/completions") -> bytes:
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": endpoint, "body": chat_body(i)}
        for i in range(n)
    ]
    return b"\n".join(orjson.dumps(line) for line in lines) + b"\n"


async def wait_batch(oai: AsyncOpenAI, batch_id: str):
    async with asyncio.timeout(30):
        while True:
            batch = await oai.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "cancelled"):
                return batch
            await asyncio.sleep(0.05)


async def test_the_openai_sdk_runs_a_batch_end_to_end(tmp_path: Path) -> None:
    async with jobs_router(tmp_path) as (router, oai):
        uploaded = await oai.files.create(
            file=("requests.jsonl", io.BytesIO(batch_file(12))), purpose="batch"
        )
        assert uploaded.purpose == "batch"
        assert uploaded.bytes == len(batch_file(12))
        batch = await oai.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"team": "evals"},
        )
        assert batch.status == "in_progress"
        assert batch.request_counts.total == 12
        done = await wait_batch(oai, batch.id)
        assert done.status == "completed"
        assert done.request_counts.completed == 12
        sample = router.metrics.registry.get_sample_value
        assert sample("kvroute_jobs_accepted_total", {"kind": "batch"}) == 12
        assert sample("kvroute_jobs_ended_total", {"outcome": "succeeded"}) == 12
        assert done.request_counts.failed == 0
        assert done.metadata == {"team": "evals"}
        assert done.error_file_id is None
        content = await oai.files.content(done.output_file_id)
        lines = [orjson.loads(line) for line in content.content.splitlines()]
        assert [line["custom_id"] for line in lines] == [f"req-{i}" for i in range(12)]
        for line in lines:
            assert line["response"]["status_code"] == 200
            assert line["response"]["body"]["usage"]["completion_tokens"] == 4
        assert (await oai.files.retrieve(done.output_file_id)).purpose == "batch_output"


async def test_a_batch_keeps_failed_lines_in_its_error_file(tmp_path: Path) -> None:
    async with jobs_router(tmp_path) as (_, oai):
        good = orjson.loads(batch_file(1))
        bad = {**good, "custom_id": "bad", "body": {**good["body"], "model": "nope"}}
        content = orjson.dumps(good) + b"\n" + orjson.dumps(bad) + b"\n"
        uploaded = await oai.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
        batch = await oai.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = await wait_batch(oai, batch.id)
        assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
        errors = (await oai.files.content(done.error_file_id)).content
        (line,) = [orjson.loads(x) for x in errors.splitlines()]
        assert line["custom_id"] == "bad"
        assert line["response"]["status_code"] == 404


async def test_a_malformed_input_file_fails_the_batch_with_its_lines(tmp_path: Path) -> None:
    async with jobs_router(tmp_path) as (_, oai):
        good = orjson.loads(batch_file(1))
        lines = [
            orjson.dumps(good),
            b"{not json",
            orjson.dumps({**good, "url": "/v1/embeddings"}),
            orjson.dumps(good),  # custom_id used twice
            orjson.dumps({**good, "custom_id": "s", "body": {**good["body"], "stream": True}}),
        ]
        uploaded = await oai.files.create(
            file=("in.jsonl", io.BytesIO(b"\n".join(lines))), purpose="batch"
        )
        batch = await oai.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.status == "failed"
        assert [e.line for e in batch.errors.data] == [2, 3, 4, 5]
        assert (await oai.batches.retrieve(batch.id)).status == "failed"


async def test_a_batch_input_file_is_checked_in_slices_between_other_requests(
    tmp_path: Path,
) -> None:
    """A long check (many good lines, then a bad one) runs on the loop in slices: a
    ticker on the same loop never waits for a large share of it. A file past the line
    limit fails on that alone, whatever its lines hold."""
    jobs = {"enabled": True, "path": str(tmp_path / "jobs.db"), "max_batch_lines": 60_000,
            "poll_s": 0.05}  # fmt: skip
    async with jobs_router(tmp_path, jobs=jobs) as (_, oai):
        content = batch_file(50_000) + b"{bad\n"
        uploaded = await oai.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
        gaps: list[float] = []
        checking = True

        async def tick() -> None:
            while checking:
                began = time.perf_counter()
                await asyncio.sleep(0.001)
                gaps.append(time.perf_counter() - began)

        gc.collect()
        gc.freeze()  # as `kvroute serve` does once started: the test's heap is not scanned
        try:
            ticker = asyncio.create_task(tick())
            began = time.perf_counter()
            batch = await oai.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            took = time.perf_counter() - began
            checking = False
            await ticker
        finally:
            gc.unfreeze()
        assert batch.status == "failed"
        assert [e.line for e in batch.errors.data] == [50_001]
        assert max(gaps) < took / 2, (max(gaps), took)  # one blocking check: ~0.8
        many = await oai.files.create(
            file=("many.jsonl", io.BytesIO(b"x\n" * 1_000_000)), purpose="batch"
        )
        batch = await oai.batches.create(
            input_file_id=many.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert [e.code for e in batch.errors.data] == ["too_many_requests"]


async def test_batch_and_file_refusals(tmp_path: Path) -> None:
    async with jobs_router(tmp_path) as (router, oai), aiohttp.ClientSession() as http:
        uploaded = await oai.files.create(
            file=("a.jsonl", io.BytesIO(batch_file(1))), purpose="batch"
        )
        for asked, param in (
            ({"endpoint": "/v1/moderations", "completion_window": "24h"}, "endpoint"),
            ({"endpoint": "/v1/completions", "completion_window": "1h"}, "completion_window"),
        ):
            body = {"input_file_id": uploaded.id, **asked}
            async with http.post(router.url + "/v1/batches", json=body) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == param
        body = {"input_file_id": "file-nope", "endpoint": "/v1/completions"}
        async with http.post(
            router.url + "/v1/batches", json={**body, "completion_window": "24h"}
        ) as r:
            assert r.status == 404
        for query in ("limit=0", "limit=101", "limit=many"):
            async with http.get(router.url + f"/v1/batches?{query}") as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "limit"
        async with http.delete(router.url + "/v1/files/file-nope") as r:
            assert r.status == 404
        form = aiohttp.FormData()
        form.add_field("purpose", "fine-tune")
        form.add_field("file", b"{}", filename="x.jsonl")
        async with http.post(router.url + "/v1/files", data=form) as r:
            assert r.status == 400
        async with http.get(router.url + f"/v1/files/{uploaded.id}/content",
                            headers={"X-Tenant": "other"}) as r:  # fmt: skip
            assert r.status == 404


async def test_an_upload_past_max_file_bytes_is_refused(tmp_path: Path) -> None:
    cfg = {"enabled": True, "path": str(tmp_path / "j2.db"), "max_file_bytes": 10_000}
    async with jobs_router(tmp_path, jobs=cfg) as (_, oai):
        with pytest.raises(Exception) as refused:
            await oai.files.create(file=("a.jsonl", io.BytesIO(b"x" * 10_001)), purpose="batch")
        assert getattr(refused.value, "status_code", None) == 413
        small = await oai.files.create(file=("a.jsonl", io.BytesIO(b"x" * 10_000)), purpose="batch")
        assert small.bytes == 10_000


async def test_an_upload_is_stored_as_it_arrives_within_the_tenants_quota(
    tmp_path: Path,
) -> None:
    """While a file is still arriving its first pieces are already in the store (only
    a piece is held in memory); the tenant's uploads stop at max_tenant_file_bytes."""
    jobs = {"enabled": True, "path": str(tmp_path / "jobs.db"),
            "max_tenant_file_bytes": 5_000_000}  # fmt: skip
    held = asyncio.Event()

    async def form():
        yield b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
        yield b"Content-Type: application/jsonl\r\n\r\n"
        for _ in range(30):
            yield b"x" * 100_000
        await held.wait()
        yield b"\r\n--b--\r\n"

    async with jobs_router(tmp_path, jobs=jobs) as (router, oai), aiohttp.ClientSession() as http:
        headers = {"Content-Type": "multipart/form-data; boundary=b"}
        upload = asyncio.create_task(
            http.post(router.url + "/v1/files", data=form(), headers=headers)
        )
        db = sqlite3.connect(tmp_path / "jobs.db")
        with closing(db):
            await until(
                lambda: db.execute("SELECT count(*) FROM file_parts").fetchone()[0] >= 2,
                timeout=10,
            )
        assert router.ingress.bodies.held <= (1 << 20) + (1 << 16)
        held.set()
        async with await upload as r:
            assert r.status == 200, await r.text()
            first = await r.json()
        assert first["bytes"] == 3_000_000
        with pytest.raises(Exception) as refused:
            await oai.files.create(file=("b.jsonl", io.BytesIO(b"y" * 2_500_000)), purpose="batch")
        assert getattr(refused.value, "status_code", None) == 413
        assert "max_tenant_file_bytes quota of 5000000 bytes" in str(refused.value)
        await oai.files.delete(first["id"])
        again = await oai.files.create(
            file=("b.jsonl", io.BytesIO(b"y" * 2_500_000)), purpose="batch"
        )
        assert again.bytes == 2_500_000
        assert (await oai.files.content(again.id)).content == b"y" * 2_500_000


@asynccontextmanager
async def store_jobs(tmp_path: Path, kind: str) -> AsyncIterator[tuple[dict, Callable]]:
    """`jobs` config for a store of `kind`, and what reads a file's stored bytes raw."""
    if kind == "sqlite":
        path = tmp_path / "jobs.db"

        def raw(file_id: str) -> bytes:
            with closing(sqlite3.connect(path)) as db:
                (whole,) = db.execute("SELECT content FROM files WHERE id = ?", (file_id,))
                parts = db.execute(
                    "SELECT data FROM file_parts WHERE file_id = ? ORDER BY n", (file_id,)
                )
                return whole[0] + b"".join(p for (p,) in parts)

        yield {"enabled": True, "path": str(path), "poll_s": 0.05}, raw
        return
    with redis_server(tmp_path) as url:
        db = redis.Redis.from_url(url)

        def raw(file_id: str) -> bytes:
            key = f"kvroute:jobs:file:{file_id}"
            return db.hget(key, "content") + b"".join(db.lrange(key + ":parts", 0, -1))

        yield {"enabled": True, "store": "redis", "redis": {"url": url}, "poll_s": 0.05}, raw
        db.close()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_a_file_downloads_a_piece_at_a_time_within_the_body_budget(
    tmp_path: Path, kind: str, caplog
) -> None:
    """The SDK gets a multi-piece upload's and a batch output's exact bytes; a download
    holds one piece of the budget, and a client gone stops it."""
    async with store_jobs(tmp_path, kind) as (jobs, raw):
        async with jobs_router(tmp_path, jobs=jobs) as (router, oai):
            data = bytes(range(256)) * (12_000_000 // 256)
            up = await oai.files.create(file=("a.jsonl", io.BytesIO(data)), purpose="batch")
            got = await oai.files.content(up.id)
            assert got.content == data
            assert got.response.headers["Content-Type"] == "application/jsonl"
            assert got.response.headers["Content-Length"] == str(len(data))
            uploaded = await oai.files.create(
                file=("in.jsonl", io.BytesIO(batch_file(5))), purpose="batch"
            )
            batch = await oai.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            done = await wait_batch(oai, batch.id)
            output = (await oai.files.content(done.output_file_id)).content
            assert output == raw(done.output_file_id) and output.count(b"\n") == 5
            async with aiohttp.ClientSession() as http:
                for file_id in (up.id, done.output_file_id):
                    url = f"{router.url}/v1/files/{file_id}/content"
                    async with http.get(url, headers={"X-Tenant": "other"}) as r:
                        assert r.status == 404
                bodies = router.ingress.bodies
                async with http.get(f"{router.url}/v1/files/{up.id}/content") as r:
                    assert r.status == 200
                    await r.content.readexactly(1 << 16)
                    assert bodies.held == PIECE_BYTES + (1 << 16)  # one piece, while it is sent
                    r.close()  # gone before the end
                await until(lambda: bodies.held == 0, timeout=10)
    assert not [
        r for r in caplog.records if r.levelno >= logging.ERROR
    ]  # a client gone is no error


async def test_cancel_drops_the_lines_not_started(tmp_path: Path) -> None:
    stub = StubBackend()
    stub.behaviour.gate = asyncio.Event()  # the lines started run until it is set
    await stub.start()
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": stub.url, "name": "stub"}],
        "jobs": {"enabled": True, "path": str(tmp_path / "jobs.db"), "concurrency": 2,
                 "poll_s": 0.05},
    }  # fmt: skip
    router = Router(build(data))
    try:
        await router.start()
        async with AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as oai:
            content = batch_file(6).replace(MODEL.encode(), stub.model.encode())
            uploaded = await oai.files.create(
                file=("in.jsonl", io.BytesIO(content)), purpose="batch"
            )
            batch = await oai.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            await until(lambda: stub.active == 2)
            cancelling = await oai.batches.cancel(batch.id)
            assert cancelling.status == "cancelling"
            stub.behaviour.gate.set()
            done = await wait_batch(oai, batch.id)
            assert done.status == "cancelled"
    finally:
        await router.stop()
        await stub.stop()
    assert done.request_counts.completed == 2
    assert stub.completed + stub.aborted == 2  # the four not started never ran


async def test_an_accepted_job_survives_kill_9_and_completes_after_restart(
    tmp_path: Path,
) -> None:
    stub = StubBackend()
    stub.behaviour.gate = asyncio.Event()  # the first attempt is mid-request when killed
    await stub.start()
    config = tmp_path / "router.yaml"
    jobs = {"enabled": True, "path": str(tmp_path / "jobs.db"), "lease_s": 1.0, "poll_s": 0.05}
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": stub.url, "name": "stub"}],
        "jobs": jobs,
        "workers": 2,
    }
    config.write_text(yaml.safe_dump(data))
    body = {**chat_body(1), "model": stub.model}
    try:
        async with aiohttp.ClientSession() as http:
            async with kvroute(config) as served:
                async with http.post(served.url + CHAT, json=body) as r:
                    assert r.status == 202
                    status_url = (await r.json())["status_url"]
                await until(lambda: stub.active == 1, timeout=10)
                # SIGKILL to the workers and the supervisor: no cleanup, the lease stays
                for proc in psutil.Process(served.proc.pid).children(recursive=True):
                    proc.kill()
                served.proc.kill()
                await served.proc.wait()
            stub.behaviour.gate.set()
            async with kvroute(config) as served:
                job = await finished(http, served.url + status_url)
    finally:
        await stub.stop()
    assert job["status"] == "succeeded"
    assert job["attempts"] == 2
    assert [r["messages"] for r in stub.received] == [body["messages"]] * 2


@asynccontextmanager
async def receiver(
    answers: list[int], location: str | None = None, gate: asyncio.Event | None = None
) -> AsyncIterator[tuple[str, list[dict], asyncio.Event]]:
    """A webhook receiver on 127.0.0.1: answers `answers` in turn (then 200), keeps the
    bodies; the event is set on each delivery. `location`: sent with each answer (a
    redirect's target); `gate`: each answer waits until it is set."""
    got: list[dict] = []
    arrived = asyncio.Event()

    async def hook(request: aiohttp.web.Request) -> aiohttp.web.Response:
        got.append(await request.json())
        arrived.set()
        if gate is not None:
            await gate.wait()
        headers = {} if location is None else {"Location": location}
        return aiohttp.web.Response(status=answers.pop(0) if answers else 200, headers=headers)

    app = aiohttp.web.Application()
    app.router.add_post("/hook", hook)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/hook", got, arrived
    finally:
        await runner.cleanup()


async def webhook_ended(http: aiohttp.ClientSession, status_url: str) -> dict:
    """The job at `status_url` once its webhook is no longer waiting or pending."""
    async with asyncio.timeout(20):
        while (job := await (await http.get(status_url)).json())["webhook"]["state"] in (
            "waiting", "pending",
        ):  # fmt: skip
            await asyncio.sleep(0.05)
    return job


def with_hooks(tmp_path: Path, url: str, **hooks) -> dict:
    """Jobs that may POST webhooks to `url`'s host and port."""
    jobs = {"enabled": True, "path": str(tmp_path / "jobs.db"), "poll_s": 0.05}
    allowed = [URL(url).raw_authority]
    return {**jobs, "webhook_hosts": allowed, "webhook_backoff_s": 0.05, **hooks}


async def test_a_webhook_gets_the_jobs_status_and_is_retried_until_it_takes(
    tmp_path: Path,
) -> None:
    async with (
        receiver([500]) as (url, got, _),
        jobs_router(tmp_path, jobs=with_hooks(tmp_path, url)) as (router, _),
        aiohttp.ClientSession() as http,
    ):
        headers = {"X-Kvroute-Webhook": url}
        async with http.post(router.url + CHAT, json=chat_body(1), headers=headers) as r:
            assert r.status == 202
            status_url = router.url + (await r.json())["status_url"]
        async with asyncio.timeout(20):
            while True:
                async with http.get(status_url) as r:
                    job = await r.json()
                if job["webhook"]["state"] == "delivered":
                    break
                await asyncio.sleep(0.05)
    assert job["webhook"] == {"url": url, "state": "delivered", "attempts": 2}
    sample = router.metrics.registry.get_sample_value
    assert sample("kvroute_webhooks_total", {"result": "retried"}) == 1
    assert sample("kvroute_webhooks_total", {"result": "delivered"}) == 1
    assert len(got) == 2  # one refused with a 500, then taken
    assert got[-1]["id"] == job["id"]
    assert got[-1]["status"] == "succeeded"
    assert got[-1]["result"]["body"]["usage"]["completion_tokens"] == 4


async def test_a_webhook_refused_every_time_is_given_up(tmp_path: Path) -> None:
    async with (
        receiver([500, 503, 500]) as (url, got, _),
        jobs_router(tmp_path, jobs=with_hooks(tmp_path, url, webhook_retries=1)) as (router, _),
        aiohttp.ClientSession() as http,
    ):
        headers = {"X-Kvroute-Webhook": url}
        async with http.post(router.url + CHAT, json=chat_body(1), headers=headers) as r:
            status_url = router.url + (await r.json())["status_url"]
        job = await webhook_ended(http, status_url)
    assert job["webhook"]["state"] == "failed"
    assert job["webhook"]["attempts"] == 2 == len(got)


async def test_a_webhook_to_a_host_not_allowed_is_refused(tmp_path: Path) -> None:
    async with jobs_router(tmp_path) as (router, _), aiohttp.ClientSession() as http:
        for hook in ("http://127.0.0.1:9/hook", "ftp://127.0.0.1/x", "not a url"):
            headers = {"X-Kvroute-Webhook": hook}
            async with http.post(router.url + CHAT, json=chat_body(1), headers=headers) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "X-Kvroute-Webhook"


async def test_a_webhook_must_name_an_allowed_port_and_redirects_are_not_followed(
    tmp_path: Path,
) -> None:
    """Only the host and port allowed take a webhook (not another port of the same
    host: the router's own, or another receiver's), a bare host allows its scheme's
    default port only, and a redirect elsewhere is a failed delivery, its target never
    POSTed to."""
    async with (
        receiver([]) as (elsewhere, stolen, _),
        receiver([307], location=elsewhere) as (url, got, _),
        jobs_router(tmp_path, jobs=with_hooks(tmp_path, url, webhook_retries=0)) as (router, _),
        aiohttp.ClientSession() as http,
    ):
        post = router.url + CHAT
        for hook in (router.url + "/v1/files", elsewhere):
            async with http.post(post, json=chat_body(1), headers={WEBHOOK: hook}) as r:
                assert r.status == 400, hook
                assert (
                    "is not among the jobs' webhook_hosts" in (await r.json())["error"]["message"]
                )
        async with http.post(post, json=chat_body(1), headers={WEBHOOK: url}) as r:
            assert r.status == 202
            status_url = router.url + (await r.json())["status_url"]
        job = await webhook_ended(http, status_url)
    assert (job["webhook"]["state"], len(got), stolen) == ("failed", 1, [])
    bare = JobsConfig(webhook_hosts=("hooks.example",))
    assert checked_webhook("https://hooks.example/x", bare)
    assert checked_webhook("http://hooks.example:80/x", bare)
    with pytest.raises(BadRequest):
        checked_webhook("http://hooks.example:8080/x", bare)


async def test_a_slow_receiver_does_not_hold_up_another_jobs_webhook(tmp_path: Path) -> None:
    gate = asyncio.Event()
    async with (
        receiver([], gate=gate) as (slow, slow_got, slow_arrived),
        receiver([]) as (fast, fast_got, fast_arrived),
    ):
        jobs = with_hooks(tmp_path, slow, webhook_timeout_s=60)
        jobs["webhook_hosts"].append(URL(fast).raw_authority)
        async with jobs_router(tmp_path, jobs=jobs) as (router, _), aiohttp.ClientSession() as http:
            for hook, arrived in ((slow, slow_arrived), (fast, fast_arrived)):
                headers = {WEBHOOK: hook}
                async with http.post(router.url + CHAT, json=chat_body(1), headers=headers) as r:
                    assert r.status == 202
                async with asyncio.timeout(15):  # the slow one is still being answered
                    await arrived.wait()
            assert not gate.is_set() and len(slow_got) == len(fast_got) == 1
            gate.set()


async def test_a_webhook_url_that_is_not_utf8_is_a_400(tmp_path: Path) -> None:
    jobs = with_hooks(tmp_path, "http://127.0.0.1/hook")  # the host, bare: its port 80
    async with jobs_router(tmp_path, jobs=jobs) as (router, _):
        raw = (
            b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nX-Kvroute-Webhook: http://127.0.0.1/h\xff\xfe\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%b"
        )
        body = orjson.dumps(chat_body(1))
        reader, writer = await asyncio.open_connection("127.0.0.1", URL(router.url).port)
        writer.write(raw % (len(body), body))
        answer = await reader.read()
        writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer
    assert orjson.loads(payload)["error"]["param"] == WEBHOOK


async def test_two_replicas_share_their_jobs_through_redis(tmp_path: Path) -> None:
    with redis_server(tmp_path) as url:
        fleet = await start_fleet(2, SimParams(time_scale=0.02))
        jobs = {"enabled": True, "store": "redis", "redis": {"url": url}, "poll_s": 0.05}
        data = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "backends": [{"url": b.url, "name": f"sim{i}"} for i, b in enumerate(fleet.backends)],
            "jobs": jobs,
        }
        replicas = [Router(build(data)), Router(build(data))]
        try:
            for router in replicas:
                await router.start()
            a, b = (AsyncOpenAI(base_url=r.url + "/v1", api_key="x") for r in replicas)
            async with aiohttp.ClientSession() as http, a, b:
                async with http.post(replicas[0].url + CHAT, json=chat_body(1)) as r:
                    status_url = (await r.json())["status_url"]
                job = await finished(http, replicas[1].url + status_url)
                assert (job["status"], job["attempts"]) == ("succeeded", 1)
                uploaded = await a.files.create(
                    file=("in.jsonl", io.BytesIO(batch_file(8))), purpose="batch"
                )
                batch = await b.batches.create(
                    input_file_id=uploaded.id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                )
                done = await wait_batch(a, batch.id)
                assert (done.status, done.request_counts.completed) == ("completed", 8)
                lines = (await b.files.content(done.output_file_id)).content.splitlines()
                assert [orjson.loads(x)["custom_id"] for x in lines] == [
                    f"req-{i}" for i in range(8)
                ]
        finally:
            for router in replicas:
                await router.stop()
            await fleet.stop()


async def test_a_job_the_router_refuses_for_now_is_tried_again(tmp_path: Path) -> None:
    """Admission full (one request at a time, no queue): the job's 429 is not its
    answer; once the interactive request ends, the job runs."""
    stub = StubBackend()
    stub.behaviour.gate = asyncio.Event()
    await stub.start()
    jobs = {"enabled": True, "path": str(tmp_path / "jobs.db"), "poll_s": 0.05,
            "refused_backoff_s": 0.05, "refused_retries": 50}  # fmt: skip
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": stub.url, "name": "stub"}],
        "limits": {"max_concurrent_requests": 1, "queue_size": 0},
        "jobs": jobs,
    }
    router = Router(build(data))
    body = {**chat_body(1), "model": stub.model}
    try:
        await router.start()
        sample = router.metrics.registry.get_sample_value
        async with aiohttp.ClientSession() as http:
            interactive = asyncio.create_task(
                http.post(router.url + "/v1/chat/completions", json=body)
            )
            await until(lambda: stub.active == 1)
            async with http.post(router.url + CHAT, json=body) as r:
                status_url = router.url + (await r.json())["status_url"]
            await until(lambda: sample("kvroute_job_refusals_retried_total") >= 2, timeout=10)
            stub.behaviour.gate.set()
            async with await interactive as answered:
                assert answered.status == 200
            job = await finished(http, status_url)
    finally:
        await router.stop()
        await stub.stop()
    assert (job["status"], job["attempts"]) == ("succeeded", 1)


async def test_with_auth_on_every_job_path_needs_a_token_and_tenants_are_kept_apart(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("KV_JOBS_TOKENS", "token-a team-a,token-b team-b")
    auth = {"enabled": True, "tokens_env": "KV_JOBS_TOKENS"}
    async with jobs_router(tmp_path, auth=auth) as (router, _), aiohttp.ClientSession() as http:
        paths = [
            ("POST", CHAT), ("GET", "/v1/async/job_x"), ("POST", "/v1/files"),
            ("GET", "/v1/files/file-x"), ("GET", "/v1/files/file-x/content"),
            ("POST", "/v1/batches"), ("GET", "/v1/batches/batch_x"),
            ("POST", "/v1/batches/batch_x/cancel"),
        ]  # fmt: skip
        for method, path in paths:
            async with http.request(method, router.url + path, json={}) as r:
                assert r.status == 401, path
                assert r.headers["WWW-Authenticate"] == "Bearer"
        a = {"Authorization": "Bearer token-a"}
        b = {"Authorization": "Bearer token-b"}
        async with http.post(router.url + CHAT, json=chat_body(1), headers=a) as r:
            assert r.status == 202
            status_url = router.url + (await r.json())["status_url"]
        assert (await finished(http, status_url, headers=a))["status"] == "succeeded"
        async with http.get(status_url, headers=b) as r:
            assert r.status == 404  # team-b's token does not see team-a's job
    async with jobs_router(tmp_path, auth=auth) as (router, _):
        a_sdk = AsyncOpenAI(base_url=router.url + "/v1", api_key="token-a", max_retries=0)
        b_sdk = AsyncOpenAI(base_url=router.url + "/v1", api_key="token-b", max_retries=0)
        async with a_sdk, b_sdk:
            uploaded = await a_sdk.files.create(
                file=("in.jsonl", io.BytesIO(batch_file(1))), purpose="batch"
            )
            with pytest.raises(Exception) as refused:
                await b_sdk.batches.create(
                    input_file_id=uploaded.id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                )
            assert getattr(refused.value, "status_code", None) == 404


async def test_unknown_job_paths_and_methods_need_a_token_first(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("KV_JOBS_TOKENS", "token-a team-a")
    auth = {"enabled": True, "tokens_env": "KV_JOBS_TOKENS"}
    unknown = [("GET", "/v1/files/file-x/y"), ("POST", "/v1/async/chat/other"),
               ("GET", "/v1/batches/b/cancel/x"), ("GET", "/v1/async/a/b")]  # fmt: skip
    wrong = [("PUT", "/v1/files"), ("DELETE", "/v1/batches/b"), ("GET", CHAT),
             ("POST", "/v1/files/file-x/content")]  # fmt: skip
    async with jobs_router(tmp_path, auth=auth) as (router, _), aiohttp.ClientSession() as http:
        for method, path in unknown + wrong:
            async with http.request(method, router.url + path) as r:
                assert r.status == 401, (method, path)
        token = {"Authorization": "Bearer token-a"}
        for (method, path), status in [(u, 404) for u in unknown] + [(w, 405) for w in wrong]:
            async with http.request(method, router.url + path, headers=token) as r:
                assert r.status == status, (method, path)
                assert (await r.json())["error"]["code"] == status


async def test_tokens_that_name_no_tenant_do_not_share_jobs_files_or_batches(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("KV_JOBS_TOKENS", "token-c,token-d")
    auth = {"enabled": True, "tokens_env": "KV_JOBS_TOKENS"}
    async with jobs_router(tmp_path, auth=auth) as (router, _), aiohttp.ClientSession() as http:
        c, d = ({"Authorization": f"Bearer token-{x}"} for x in "cd")
        async with http.post(router.url + CHAT, json=chat_body(1), headers=c) as r:
            status_url = router.url + (await r.json())["status_url"]
        c_sdk = AsyncOpenAI(base_url=router.url + "/v1", api_key="token-c", max_retries=0)
        d_sdk = AsyncOpenAI(base_url=router.url + "/v1", api_key="token-d", max_retries=0)
        async with c_sdk, d_sdk:
            uploaded = await c_sdk.files.create(
                file=("in.jsonl", io.BytesIO(batch_file(1))), purpose="batch"
            )
            batch = await c_sdk.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            assert [f.id async for f in d_sdk.files.list()] == []
            assert [b.id async for b in d_sdk.batches.list()] == []
            for method, path in (
                ("GET", status_url.removeprefix(router.url)),
                ("GET", f"/v1/files/{uploaded.id}"),
                ("GET", f"/v1/files/{uploaded.id}/content"),
                ("DELETE", f"/v1/files/{uploaded.id}"),
                ("GET", f"/v1/batches/{batch.id}"),
                ("POST", f"/v1/batches/{batch.id}/cancel"),
            ):
                async with http.request(method, router.url + path, headers=d) as r:
                    assert r.status == 404, path
            assert (await finished(http, status_url, headers=c))["status"] == "succeeded"
            assert (await c_sdk.files.retrieve(uploaded.id)).id == uploaded.id
            assert (await wait_batch(c_sdk, batch.id)).status == "completed"
        sample = router.metrics.registry.get_sample_value
        assert sample("kvroute_jobs_ended_total", {"outcome": "succeeded"}) == 2
    db = sqlite3.connect(tmp_path / "jobs.db")
    with closing(db):
        owners = {row[0] for row in db.execute("SELECT tenant FROM files")}
    assert len(owners) == 1 and not any("token-c" in o for o in owners)


async def test_the_sdk_lists_batches_and_files_and_deletes_a_file(tmp_path: Path) -> None:
    async with jobs_router(tmp_path) as (_, oai):
        created = []
        for _ in range(3):
            uploaded = await oai.files.create(
                file=("in.jsonl", io.BytesIO(batch_file(1))), purpose="batch"
            )
            batch = await oai.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            created.append(batch.id)
        listed = [b.id async for b in oai.batches.list(limit=2)]  # two pages, followed
        assert listed == created[::-1]
        files = [f async for f in oai.files.list(purpose="batch")]
        assert len(files) == 3
        deleted = await oai.files.delete(files[0].id)
        assert (deleted.id, deleted.deleted) == (files[0].id, True)
        assert len([f async for f in oai.files.list(purpose="batch")]) == 2


async def test_a_job_waits_below_every_interactive_class(tmp_path: Path) -> None:
    """One slot, held: a job queued before a sheddable interactive request still goes
    after it."""
    stub = StubBackend()
    stub.behaviour.gate = asyncio.Event()
    await stub.start()
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": stub.url, "name": "stub"}],
        "limits": {"max_concurrent_requests": 1, "queue_size": 8, "queue_timeout": 30},
        "jobs": {"enabled": True, "path": str(tmp_path / "jobs.db"), "poll_s": 0.05},
    }
    router = Router(build(data))
    queued = lambda n: lambda: router.dispatcher.admission.queued == n  # noqa: E731

    def body(text: str) -> dict:
        return {"model": stub.model, "messages": [{"role": "user", "content": text}]}

    try:
        await router.start()
        async with aiohttp.ClientSession() as http:
            url = router.url + "/v1/chat/completions"
            held = asyncio.create_task(http.post(url, json=body("held")))
            await until(lambda: stub.active == 1)
            async with http.post(router.url + CHAT, json=body("job")) as r:
                status_url = router.url + (await r.json())["status_url"]
            await until(queued(1), timeout=10)
            low = {"X-Kvroute-Priority": "sheddable"}
            shed = asyncio.create_task(http.post(url, json=body("shed"), headers=low))
            await until(queued(2))
            stub.behaviour.gate.set()
            for task in (held, shed):
                async with await task as answered:
                    assert answered.status == 200
            job = await finished(http, status_url)
    finally:
        await router.stop()
        await stub.stop()
    assert job["status"] == "succeeded"
    assert [r["messages"][0]["content"] for r in stub.received] == ["held", "shed", "job"]
