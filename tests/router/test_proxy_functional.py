"""The router as a drop-in vLLM endpoint: real OpenAI SDK and aiohttp clients, real
stub backends, everything over 127.0.0.1 sockets."""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import struct
import time

import aiohttp
import openai
import orjson
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from router.config import build
from router.control.worker import Router
from tests.router.conftest import running, settle

MODEL = "stub-model"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def client(router) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=10)


async def test_chat_and_completions_non_stream_and_stream() -> None:
    async with running(2) as (router, _stubs):
        async with client(router) as oai:
            raw = await oai.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT)
            assert raw.parse().choices[0].message.content == "tok0 tok1 tok2 "
            assert raw.headers["x-kvroute-backend"] in {"b0", "b1"}
            assert raw.headers["x-request-id"]

            stream = await oai.chat.completions.create(model=MODEL, messages=CHAT, stream=True)
            deltas = [c.choices[0].delta.content async for c in stream]
            assert deltas == ["tok0 ", "tok1 ", "tok2 "]

            done = await oai.completions.create(model=MODEL, prompt="once upon")
            assert done.choices[0].text == "tok0 tok1 tok2 "
            stream = await oai.completions.create(model=MODEL, prompt=[1, 2, 3], stream=True)
            assert [c.choices[0].text async for c in stream] == ["tok0 ", "tok1 ", "tok2 "]

            emb = await oai.embeddings.create(model=MODEL, input="vectorize me")
            assert emb.data[0].embedding == [0.1, 0.2]
            await settle(router)


async def test_body_and_request_id_are_forwarded_unchanged() -> None:
    async with running(1) as (router, stubs):
        body = (
            b'{"model": "stub-model",  "messages": [{"role":"user","content":"x"}], "x_extra": 1}'
        )
        headers = {"Content-Type": "application/json", "X-Request-Id": "req-42"}
        async with aiohttp.ClientSession() as http:
            url = router.url + "/v1/chat/completions"
            async with http.post(url, data=body, headers=headers) as resp:
                assert resp.status == 200
                assert resp.headers["X-Request-Id"] == "req-42"
                assert resp.headers["x-kvroute-backend"] == "b0"
        assert stubs[0].raw[-1] == body  # the original bytes, unknown fields and spacing kept
        assert stubs[0].headers[-1]["X-Request-Id"] == "req-42"


async def test_stream_arrives_chunk_by_chunk() -> None:
    """Each chunk reaches the client as the backend sends it, not at the end."""
    pace, n = 0.2, 5
    async with running(1) as (router, stubs):
        stubs[0].behaviour.chunks, stubs[0].behaviour.pace = n, pace
        arrivals: list[float] = []
        payload = {"model": MODEL, "messages": CHAT, "stream": True}
        async with aiohttp.ClientSession() as http:
            async with http.post(router.url + "/v1/chat/completions", json=payload) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        arrivals.append(time.monotonic())
        assert len(arrivals) == n
        sent = stubs[0].chunk_sent_at
        lags = [a - s for a, s in zip(arrivals, sent, strict=True)]
        # every chunk arrives long before the next one is even sent
        assert max(lags) < pace / 2, lags
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        assert min(gaps) > pace / 2, gaps
        await settle(router)
        # the paced gaps reach the inter-token histogram once the stream ended
        page = router.metrics.render()
        itl = _samples(page, "kvroute_inter_token_latency_seconds", endpoint="chat")
        paced = itl["_bucket", "0.25"] - itl["_bucket", "0.1"]
        assert paced == n - 1, itl
        assert itl["_sum", None] >= (n - 1) * pace * 0.9, itl


def _samples(text: bytes, family: str, **labels: str) -> dict[tuple[str, str | None], float]:
    """One histogram's samples with `labels` (others are primed at 0), keyed by suffix
    and `le`."""
    (found,) = (f for f in text_string_to_metric_families(text.decode()) if f.name == family)
    return {
        (s.name[len(family) :], s.labels.get("le")): s.value
        for s in found.samples
        if labels.items() <= s.labels.items()
    }


@pytest.mark.parametrize(
    ("stream", "pace"),
    [(True, 0.2), (True, 60.0), (False, 0.0)],
    ids=["stream", "stream-paused", "non-stream"],
)
async def test_client_disconnect_aborts_upstream(stream: bool, pace: float) -> None:
    """The backend is let go at once, also while a begun stream pauses (nothing is
    written that could find the client gone: its FIN is taken as leaving)."""
    async with running(1) as (router, stubs):
        b = stubs[0].behaviour
        if stream:
            b.chunks, b.pace = 50, pace
        else:
            b.delay = 30
        payload = {"model": MODEL, "messages": CHAT, "stream": stream}
        async with aiohttp.ClientSession() as http:
            resp = (
                await http.post(router.url + "/v1/chat/completions", json=payload)
                if stream
                else None
            )
            if stream:
                await resp.content.readline()  # the first chunk arrived
                resp.close()
            else:
                task = asyncio.create_task(
                    http.post(router.url + "/v1/chat/completions", json=payload)
                )
                async with asyncio.timeout(5):
                    while not stubs[0].active:
                        await asyncio.sleep(0.01)
                task.cancel()
        async with asyncio.timeout(5):
            while not stubs[0].aborted:
                await asyncio.sleep(0.01)
        assert stubs[0].completed == 0
        await settle(router)


async def test_a_client_reset_mid_stream_is_counted_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that resets its connection while chunks flow: the relay's write fails, the
    request counts as a 499 and the backend is let go, with no traceback logged."""
    caplog.set_level(logging.ERROR, logger="kvroute.http")
    async with running(1) as (router, stubs):
        stubs[0].behaviour.chunks, stubs[0].behaviour.pace = 100_000, 0.0005
        body = orjson.dumps({"model": MODEL, "messages": CHAT, "stream": True})
        request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
        for _ in range(20):
            reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
            writer.write(request % (len(body), body))
            await reader.readuntil(b"data: ")
            await asyncio.sleep(0.02)  # chunks keep coming
            linger = struct.pack("ii", 1, 0)  # close with a reset
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            writer.close()
        await settle(router)
    # the router's own records (the stub backend's aiohttp may log its side of the cut)
    ours = [r for r in caplog.records if r.name.startswith(("kvroute", "asyncio"))]
    assert not [r for r in ours if r.levelno >= logging.ERROR]


async def test_mid_stream_failure_ends_with_error_event_and_done() -> None:
    async with running(1) as (router, stubs):
        stubs[0].behaviour.chunks, stubs[0].behaviour.cut_after_chunks = 5, 2
        payload = {"model": MODEL, "messages": CHAT, "stream": True}
        async with aiohttp.ClientSession() as http:
            async with http.post(router.url + "/v1/chat/completions", json=payload) as resp:
                assert resp.status == 200
                events = [ln for ln in (await resp.read()).split(b"\n") if ln.startswith(b"data: ")]
        assert len(events) == 4
        error = orjson.loads(events[2][6:])["error"]
        assert error["code"] == 502
        assert error["message"] == f"Backend b0 (127.0.0.1:{stubs[0].port}) broke off the stream."
        assert events[3] == b"data: [DONE]"
        await settle(router)
        # the SDK surfaces it as an error instead of hanging
        async with client(router) as oai:
            stream = await oai.chat.completions.create(model=MODEL, messages=CHAT, stream=True)
            with pytest.raises(openai.APIError):
                async for _ in stream:
                    pass
        await settle(router)


async def test_idle_timeout_mid_stream_ends_stream() -> None:
    async with running(1, timeouts={"idle": 0.3}) as (router, stubs):
        stubs[0].behaviour.chunks, stubs[0].behaviour.hang_after_chunks = 5, 1
        payload = {"model": MODEL, "messages": CHAT, "stream": True}
        async with aiohttp.ClientSession() as http:
            async with http.post(router.url + "/v1/chat/completions", json=payload) as resp:
                body = await asyncio.wait_for(resp.read(), 5)
        assert b'"code":504' in body and body.endswith(b"data: [DONE]\n\n")
        await settle(router)
        async with asyncio.timeout(5):
            while not stubs[0].aborted:
                await asyncio.sleep(0.01)


async def test_a_stream_paced_within_idle_outlives_it() -> None:
    """The idle timer wakes at its deadline and, a chunk having come since (stamped by
    perf_counter, the timer on the loop's clock), sleeps on: a stream whose chunks come
    more often than `idle` runs past several idle periods."""
    async with running(1, timeouts={"idle": 0.2}) as (router, stubs):
        stubs[0].behaviour.chunks, stubs[0].behaviour.pace = 8, 0.07
        payload = {"model": MODEL, "messages": CHAT, "stream": True}
        async with aiohttp.ClientSession() as http:
            async with http.post(router.url + "/v1/chat/completions", json=payload) as resp:
                body = await asyncio.wait_for(resp.read(), 5)
        assert b'"code":504' not in body and body.count(b"data: ") == 9  # 8 and [DONE]
        await settle(router)


async def _status(url: str, **kwargs) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as http, http.post(url, **kwargs) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


@pytest.mark.parametrize(
    ("kwargs", "status", "text", "param"),
    [
        pytest.param({"data": b"{not json"}, 400, "not valid JSON", None, id="malformed-json"),
        pytest.param(
            {"json": {"model": MODEL}}, 400, "Field required: `messages`", "messages", id="missing"
        ),
        pytest.param(
            {"json": {"model": MODEL, "messages": []}},
            400,
            "`messages` must not be empty",
            "messages",
            id="empty",
        ),
        pytest.param(
            {"json": {"model": MODEL, "messages": "hi"}},
            400,
            "$.messages",
            "messages",
            id="wrong-type",
        ),
        pytest.param(
            {"json": {"model": MODEL, "messages": [{"role": 1}]}},
            400,
            "$.messages[0].role",
            "messages[0].role",
            id="wrong-nested-type",
        ),
        pytest.param(
            {"json": {"model": "gpt-nope", "messages": CHAT}},
            404,
            "gpt-nope",
            "model",
            id="unknown-model",
        ),
        pytest.param({"data": b"x" * 5000}, 413, "exceeds the limit", None, id="too-large"),
    ],
)
async def test_client_errors(kwargs: dict, status: int, text: str, param: str | None) -> None:
    async with running(1, limits={"max_body_bytes": 4096}) as (router, stubs):
        code, _, body = await _status(router.url + "/v1/chat/completions", **kwargs)
        assert code == status
        assert body["error"]["code"] == status and text in body["error"]["message"]
        assert body["error"]["param"] == param
        assert stubs[0].received == []  # nothing reached the backend
        await settle(router)


async def test_backend_errors() -> None:
    url_path = "/v1/chat/completions"
    payload = {"json": {"model": MODEL, "messages": CHAT}}
    async with running(1, timeouts={"first_byte": 0.3}) as (router, stubs):
        stubs[0].behaviour.status = 500  # a backend error is passed through as is
        code, _, body = await _status(router.url + url_path, **payload)
        assert (code, body["error"]["message"]) == (500, "stub failure")

        # the upstream failures name the backend, in the header and the message
        b0 = f"Backend b0 (127.0.0.1:{stubs[0].port})"
        stubs[0].behaviour.status, stubs[0].behaviour.hang_before_headers = 200, True
        code, headers, body = await _status(router.url + url_path, **payload)
        assert code == 504 and body["error"]["type"] == "GatewayTimeoutError"
        assert body["error"]["message"] == f"{b0} did not answer in time."
        assert headers["x-kvroute-backend"] == "b0"
        await settle(router)

        await stubs[0].stop()  # connection refused: the only candidate failed, a 503
        code, headers, body = await _status(router.url + url_path, **payload)
        assert code == 503 and headers["Retry-After"] == "1"
        assert body["error"]["message"] == (
            f"No backend is available for model `{MODEL}`; retry shortly. "
            f"Every backend tried failed; last: {b0} refused the connection."
        )
        assert headers["x-kvroute-backend"] == "b0"  # who failed, as in a 502
        assert not router.fleet.members[0].healthy  # down at once: not tried again

        code, headers, body = await _status(router.url + url_path, **payload)
        assert code == 503 and headers["Retry-After"] == "1"
        no_model = {"json": {"messages": CHAT}}
        code, _, body = await _status(router.url + url_path, **no_model)
        assert code == 503
        message = body["error"]["message"]
        assert message == "No backend is available (the request named no model); retry shortly."
        await settle(router)


async def test_a_502_after_retries_names_the_last_backend_tried() -> None:
    """The retry budget (one) ran out with a backend left untried: the last failure."""
    config = {"health": {"enabled": False}, "retries": {"max_retries": 1}}
    async with running(3, **config) as (router, stubs):
        for stub in stubs:
            await stub.stop()
        url = router.url + "/v1/chat/completions"
        code, headers, body = await _status(url, json={"model": MODEL, "messages": CHAT})
        assert code == 502
        last = headers["x-kvroute-backend"]
        port = stubs[int(last[1])].port
        assert (
            body["error"]["message"] == f"Backend {last} (127.0.0.1:{port}) refused the connection."
        )
        retried = _retries(router.metrics.render())
        ((first, _),) = retried  # one retry: the first was tried, then the last
        assert first != last and retried == {(first, "connect"): 1.0}


def _retries(text: bytes) -> dict[tuple[str, str], float]:
    """kvroute_retries_total by backend and reason, where counted."""
    (found,) = (
        f for f in text_string_to_metric_families(text.decode()) if f.name == "kvroute_retries"
    )
    return {
        (s.labels["backend"], s.labels["reason"]): s.value
        for s in found.samples
        if s.name == "kvroute_retries_total" and s.value
    }


async def test_concurrency_limit_answers_503() -> None:
    async with running(1, limits={"max_concurrent_requests": 2, "queue_size": 0}) as (
        router,
        stubs,
    ):
        stubs[0].behaviour.delay = 1.0
        payload = {"json": {"model": MODEL, "messages": CHAT}}
        url = router.url + "/v1/chat/completions"
        results = await asyncio.gather(*(_status(url, **payload) for _ in range(4)))
        codes = sorted(r[0] for r in results)
        assert codes == [200, 200, 503, 503]
        assert all(r[1].get("Retry-After") == "1" for r in results if r[0] == 503)
        await settle(router)


async def test_models_health_ready_metrics() -> None:
    async with running(2) as (router, stubs):
        async with aiohttp.ClientSession() as http:
            async with http.get(router.url + "/v1/models") as resp:
                assert [c["id"] for c in (await resp.json())["data"]] == [MODEL]
            async with http.get(router.url + "/health") as resp:
                assert resp.status == 200
            async with http.get(router.url + "/ready") as resp:
                assert resp.status == 200
            async with client(router) as oai:
                await oai.chat.completions.create(model=MODEL, messages=CHAT)
            async with http.get(router.url + "/metrics") as resp:
                text = await resp.text()
        names = {f.name for f in text_string_to_metric_families(text)}
        for name in (
            "kvroute_requests",
            "kvroute_policy_decisions",
            "kvroute_routing_decision_seconds",
            "kvroute_backend_inflight_requests",
            "kvroute_e2e_request_latency_seconds",
        ):
            assert name in names
        for stub in stubs:
            await stub.stop()
        for backend in router.fleet.members:
            router.fleet.set_healthy(backend, False)
        async with aiohttp.ClientSession() as http, http.get(router.url + "/ready") as resp:
            assert resp.status == 503


async def test_every_answer_carries_a_request_id() -> None:
    """The client's X-Request-Id comes back; without one, each answer gets a new one."""
    answers = [
        ("GET", "/v1/nothing-here", 404),
        ("GET", "/v1/chat/completions", 405),
        ("GET", "/v1/models", 200),
        ("GET", "/health", 200),
        ("GET", "/ready", 200),
        ("GET", "/metrics", 200),
        ("POST", "/v1/chat/completions", 200),
    ]
    async with running(1) as (router, _), aiohttp.ClientSession() as http:
        made = set()
        for method, path, status in answers:
            kwargs = {"json": {"model": MODEL, "messages": CHAT}} if method == "POST" else {}
            async with http.request(method, router.url + path, **kwargs) as resp:
                assert resp.status == status
                made.add(resp.headers["X-Request-Id"])
            mine = "mine-" + path.replace("/", ".")  # token characters: kept as sent
            headers = {"X-Request-Id": mine}
            async with http.request(method, router.url + path, headers=headers, **kwargs) as resp:
                assert resp.headers["X-Request-Id"] == mine
        assert len(made) == len(answers) and "" not in made


async def test_unknown_path_is_openai_style_404() -> None:
    async with running(1) as (router, _), aiohttp.ClientSession() as http:
        async with http.get(router.url + "/v1/nothing-here") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == 404
        async with http.post(router.url + "/tokenize", json={"prompt": "abcdefgh"}) as resp:
            assert (await resp.json())["count"] == 2


async def test_prefix_aware_reads_tools_and_rejects_mixed_prompts() -> None:
    async with running(2, {"strategy": "PREFIX_AWARE"}) as (router, stubs):
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        async with client(router) as oai:
            reply = await oai.chat.completions.create(model=MODEL, messages=CHAT, tools=tools)
        assert reply.choices[0].message.content
        code, _, body = await _status(
            router.url + "/v1/completions", json={"model": MODEL, "prompt": ["text", 7]}
        )
        assert code == 400 and body["error"]["param"] == "prompt"
        assert sum(len(s.received) for s in stubs) == 1


async def test_a_failed_start_raises_its_own_error_and_releases_everything() -> None:
    async with running(1) as (router, stubs):
        config = {"listen": {"host": "127.0.0.1", "port": router.port}}
        other = Router(build({**config, "backends": [{"url": stubs[0].url}]}))
        with pytest.raises(OSError):  # the port is taken; not an error of the cleanup
            await other.start()
        assert all(task.done() for task in other._tasks)


async def test_not_ready_at_start_when_no_backend_answers() -> None:
    async with running(1) as (_, stubs):
        dead_url = stubs[0].url
    router = Router(
        build({"listen": {"host": "127.0.0.1", "port": 0}, "backends": [{"url": dead_url}]})
    )
    await router.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(router.url + "/ready") as resp:
                assert resp.status == 503
    finally:
        await router.stop()
