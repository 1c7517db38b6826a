"""Async jobs and OpenAI batches end to end: simulated vLLM servers, the router with
`jobs` on, the OpenAI SDK's files and batches calls, and a `kvroute serve` killed with
SIGKILL mid-job whose next start finishes it."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import orjson
import psutil
import pytest
import yaml
from openai import AsyncOpenAI

from bench.sim.fleet import start_fleet
from bench.sim.params import SimParams
from router.config import build
from router.control.worker import Router
from tests.redis_server import redis_server
from tests.router.chaos import until
from tests.router.test_signals_functional import kvroute
from tests.stub_backend import StubBackend

MODEL = "sim-llama-70b"
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
async def receiver(answers: list[int]) -> AsyncIterator[tuple[str, list[dict], asyncio.Event]]:
    """A webhook receiver on 127.0.0.1: answers `answers` in turn (then 200), keeps the
    bodies; the event is set on each delivery."""
    got: list[dict] = []
    arrived = asyncio.Event()

    async def hook(request: aiohttp.web.Request) -> aiohttp.web.Response:
        got.append(await request.json())
        arrived.set()
        return aiohttp.web.Response(status=answers.pop(0) if answers else 200)

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


def with_hooks(tmp_path: Path, **hooks) -> dict:
    jobs = {"enabled": True, "path": str(tmp_path / "jobs.db"), "poll_s": 0.05}
    return {**jobs, "webhook_hosts": ["127.0.0.1"], "webhook_backoff_s": 0.05, **hooks}


async def test_a_webhook_gets_the_jobs_status_and_is_retried_until_it_takes(
    tmp_path: Path,
) -> None:
    async with (
        receiver([500]) as (url, got, _),
        jobs_router(tmp_path, jobs=with_hooks(tmp_path)) as (router, _),
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
    jobs = with_hooks(tmp_path, webhook_retries=1)
    async with (
        receiver([500, 503, 500]) as (url, got, _),
        jobs_router(tmp_path, jobs=jobs) as (router, _),
        aiohttp.ClientSession() as http,
    ):
        headers = {"X-Kvroute-Webhook": url}
        async with http.post(router.url + CHAT, json=chat_body(1), headers=headers) as r:
            status_url = router.url + (await r.json())["status_url"]
        async with asyncio.timeout(20):
            while (job := await (await http.get(status_url)).json())["webhook"]["state"] in (
                "waiting", "pending",
            ):  # fmt: skip
                await asyncio.sleep(0.05)
    assert job["webhook"]["state"] == "failed"
    assert job["webhook"]["attempts"] == 2 == len(got)


async def test_a_webhook_to_a_host_not_allowed_is_refused(tmp_path: Path) -> None:
    async with jobs_router(tmp_path) as (router, _), aiohttp.ClientSession() as http:
        for hook in ("http://127.0.0.1:9/hook", "ftp://127.0.0.1/x", "not a url"):
            headers = {"X-Kvroute-Webhook": hook}
            async with http.post(router.url + CHAT, json=chat_body(1), headers=headers) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "X-Kvroute-Webhook"


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
