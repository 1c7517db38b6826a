"""Data capture end to end: simulated vLLM servers, the router with capture on, the openai
SDK and aiohttp as clients; the records read back from the files once the router
stopped (its stop writes what is queued)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import orjson
import pytest
from openai import AsyncOpenAI

from bench.harness import recommend
from bench.harness.workloads import WorkloadSpec, generate
from bench.sim.fleet import start_fleet
from bench.sim.params import SimParams
from router.config import build
from router.control.worker import Router

MODEL = "sim-llama-70b"


@asynccontextmanager
async def captured(capture: dict, **config: object) -> AsyncIterator[Router]:
    """Two simulated backends behind a router capturing as `capture` says."""
    fleet = await start_fleet(2, SimParams(time_scale=0.02))
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": b.url, "name": f"sim{i}"} for i, b in enumerate(fleet.backends)],
        "capture": {"enabled": True, **capture},
        **config,
    }
    router = Router(build(data))
    try:
        await router.start()
        yield router
    finally:
        await router.stop()
        await fleet.stop()


def records(path: Path) -> list[dict]:
    """Every line of every capture file under `path`."""
    return [orjson.loads(x) for f in sorted(path.iterdir()) for x in f.read_bytes().splitlines()]


async def ask(oai: AsyncOpenAI, i: int, stream: bool, **extra: object) -> tuple[str, int]:
    """Question `i`, read whole: its text and prompt tokens (as the SDK saw them)."""
    messages = [{"role": "user", "content": f"question number {i}: what is {i} squared?"}]
    if not stream:
        answer = await oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, **extra
        )
        return answer.choices[0].message.content, answer.usage.prompt_tokens
    chunks = [
        c
        async for c in await oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, stream=True,
            stream_options={"include_usage": True}, **extra,
        )
    ]  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage.prompt_tokens


async def test_streamed_and_whole_answers_are_captured_complete_under_concurrency(
    tmp_path,
) -> None:
    capture = {"sample": 1.0, "path": str(tmp_path), "redact": ["X-Secret"]}
    async with captured(capture) as router:
        url = router.url + "/v1"
        headers = {"X-Secret": "hush", "X-Team": "search"}
        async with AsyncOpenAI(
            base_url=url, api_key="sk-client", max_retries=0, timeout=20, default_headers=headers
        ) as oai:
            answers = await asyncio.gather(*(ask(oai, i, stream=i % 2 == 0) for i in range(12)))
    by_question = {r["request"]["messages"][0]["content"]: r for r in records(tmp_path)}
    assert len(by_question) == 12
    for i, (text, prompt_tokens) in enumerate(answers):
        record = by_question[f"question number {i}: what is {i} squared?"]
        assert (record["v"], record["status"], record["model"]) == (1, 200, MODEL)
        assert record["backend"] in {"sim0", "sim1"} and record["strategy"] == "KV_AWARE"
        assert record["usage"]["prompt_tokens"] == prompt_tokens
        assert record["usage"]["completion_tokens"] == 6
        sent = {k.lower(): v for k, v in record["headers"].items()}
        assert sent["authorization"] == sent["x-secret"] == "[redacted]"
        assert sent["x-team"] == "search"
        response = record["response"]
        if i % 2 == 0:  # a stream's TTFT is its first event's; a whole answer has none
            assert 0 < record["ttft_ms"] <= record["duration_ms"]
            assert response["stream"] is True and response["content"] == text
            assert response["events"] >= 6 and response["usage"]["prompt_tokens"] == prompt_tokens
        else:
            assert response["choices"][0]["message"]["content"] == text
    assert router.metrics.capture_written._value.get() == 12


def questions(path: Path) -> dict[str, str | None]:
    """The captured questions' numbers, and their tenants."""
    return {
        r["request"]["messages"][0]["content"].split(":")[0]: r["tenant"] for r in records(path)
    }


@pytest.mark.parametrize("anyone", [True, False], ids=["force-header-anyone", "by-default"])
async def test_a_tenant_and_the_force_header_are_captured_and_nothing_else(
    tmp_path, anyone: bool
) -> None:
    """With auth off the force header counts only where `force_header_anyone` says."""
    capture = {"sample": 0.0, "path": str(tmp_path), "tenants": ["acme"]}
    capture["force_header_anyone"] = anyone
    async with captured(capture, tenant_header="X-Tenant") as router:
        async with AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as oai:
            await ask(oai, 1, stream=False, extra_headers={"X-Tenant": "acme"})
            await ask(oai, 2, stream=True, extra_headers={"X-Tenant": "beta"})
            await ask(
                oai, 3, stream=True, extra_headers={"X-Tenant": "beta", "X-Kvroute-Capture": "1"}
            )
            await ask(oai, 4, stream=False)
    forced = {"question number 3": "beta"} if anyone else {}
    assert questions(tmp_path) == {"question number 1": "acme", **forced}


async def test_with_auth_only_the_force_tenants_tokens_can_force_a_capture(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROUTE_TEST_CAPTURE_TOKENS", "tok-ops ops,tok-beta beta")
    capture = {"sample": 0.0, "path": str(tmp_path), "force_tenants": ["ops"]}
    auth = {"enabled": True, "tokens_env": "KVROUTE_TEST_CAPTURE_TOKENS"}
    force = {"X-Kvroute-Capture": "1"}
    async with captured(capture, auth=auth) as router:
        for i, token in enumerate(("tok-ops", "tok-beta")):
            async with AsyncOpenAI(
                base_url=router.url + "/v1", api_key=token, max_retries=0
            ) as oai:
                await ask(oai, 2 * i, stream=False, extra_headers=force)
                await ask(oai, 2 * i + 1, stream=True)
    assert questions(tmp_path) == {"question number 0": "ops"}


async def test_the_aiohttp_path_captures_the_body_as_sent_and_off_keeps_figures_only(
    tmp_path,
) -> None:
    """A chunked request body is served by aiohttp's server, not the fast path."""
    capture = {"sample": 1.0, "path": str(tmp_path), "response": False}
    body = b'{"model": "sim-llama-70b", "max_tokens": 4, "stream": true,  "prompt": "odd  spacing"}'

    async def chunked() -> AsyncIterator[bytes]:
        yield body[:20]
        yield body[20:]

    async with captured(capture) as router:
        async with aiohttp.ClientSession() as http:
            async with http.post(router.url + "/v1/completions", data=chunked()) as resp:
                assert resp.status == 200
                assert b"data: [DONE]" in await resp.read()
    (record,) = records(tmp_path)
    assert record["request"] == orjson.loads(body) and "response" not in record
    assert record["path"] == "/v1/completions" and record["ttft_ms"] > 0


async def test_the_headers_recorded_are_the_clients_as_sent(tmp_path) -> None:
    """Compression on: the router takes the client's Accept-Encoding for itself and adds
    its X-Request-Id to what the backend gets; the record keeps what the client sent."""
    capture = {"sample": 1.0, "path": str(tmp_path)}
    sent = {"Accept-Encoding": "gzip", "Authorization": "Bearer sk-client", "X-Team": "search"}
    body = {"model": MODEL, "max_tokens": 4, "prompt": "headers as sent"}
    async with captured(capture, compression={"enabled": True, "min_bytes": 1}) as router:
        async with aiohttp.ClientSession() as http:
            for stream in (False, True):
                async with http.post(
                    router.url + "/v1/completions", json={**body, "stream": stream}, headers=sent
                ) as resp:
                    assert resp.status == 200 and resp.headers["Content-Encoding"] == "gzip"
                    assert resp.headers["X-Request-Id"]
                    await resp.read()
    got = [{k.lower(): v for k, v in r["headers"].items()} for r in records(tmp_path)]
    assert len(got) == 2
    for headers in got:
        assert headers["accept-encoding"] == "gzip" and headers["x-team"] == "search"
        assert headers["authorization"] == "[redacted]"
        assert "x-request-id" not in headers


async def test_recommend_reads_a_long_prefix_runs_capture_and_covers_the_shared_part(
    tmp_path, capsys
) -> None:
    """A real capture: a long-prefix workload (4 documents of 2,000 tokens, 6 questions
    each) through the router, then `kvroute recommend` on the files it wrote."""
    spec = WorkloadSpec(shape="long-prefix", requests=24, groups=4, prefix_tokens=2000, rate=4)
    async with captured({"sample": 1.0, "path": str(tmp_path / "cap")}) as router:
        async with AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as oai:
            for wave in (0, 1):  # the second wave finds the documents cached
                wanted = [r for r in generate(spec) if r.index % 2 == wave]
                await asyncio.gather(*(_whole(oai, r.messages, bool(r.index % 4)) for r in wanted))
    files = [str(f) for f in (tmp_path / "cap").iterdir()]
    assert recommend.main([*files, "--json"]) == 0
    doc = orjson.loads(capsys.readouterr().out)
    prefixes = doc["prefixes"]
    assert (prefixes["requests"], prefixes["groups"]) == (24, 4)
    shared = prefixes["group_shared_tokens"]["p10"]
    assert shared >= 1984  # each group's document, to the 16-token block
    (prefix_aware,) = [s for s in doc["advice"] if s["strategy"] == "PREFIX_AWARE"]
    assert prefixes["global_tokens"] < prefix_aware["params"]["prefix_length"] <= shared


async def _whole(oai: AsyncOpenAI, messages: list[dict], stream: bool) -> None:
    """One request, its answer read to the end."""
    answer = await oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, stream=stream
    )
    if stream:
        assert [chunk async for chunk in answer]
