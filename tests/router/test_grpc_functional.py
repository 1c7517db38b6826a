"""The gRPC ingress end to end: a real grpcio aio client → the router → stub vLLM backends.

Everything runs on 127.0.0.1 with bounded timeouts; `running()` stops every server.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import grpc
import orjson
import pytest
from aiohttp import web
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from proto.kvroute.v1 import kvroute_pb2 as pb
from proto.kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from router.config import build
from router.control.worker import Router
from tests.router.conftest import running, settle
from tests.stub_backend import StubBackend

MODEL = "stub-model"
SERVICE = "kvroute.v1.Inference"
TIMEOUT = 10.0


def chat_request(*texts: str, **fields) -> pb.ChatCompletionRequest:
    messages = [pb.ChatMessage(role="system", content="be brief")]
    messages += [pb.ChatMessage(role="user", content=t) for t in texts or ("hello",)]
    return pb.ChatCompletionRequest(model=MODEL, messages=messages, **fields)


@dataclass
class Rig:
    router: Router
    stubs: list[StubBackend]
    channel: grpc.aio.Channel
    api: pb_grpc.InferenceStub


@asynccontextmanager
async def grpc_router(n: int = 1, routing: dict | None = None, **config) -> AsyncIterator[Rig]:
    """`running()` with the gRPC ingress on an ephemeral port, and a channel to it."""
    async with running(n, routing, grpc={"enabled": True, "port": 0}, **config) as (
        router,
        stubs,
    ):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
            yield Rig(router, stubs, channel, pb_grpc.InferenceStub(channel))


async def wait_for(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


# ------------------------------------------------------------------ unary and streaming


async def test_unary_chat_maps_fields_metadata_and_trailers() -> None:
    async with grpc_router(tenant_header="X-Tenant-Id") as rig:
        request = chat_request(
            sampling=pb.SamplingParams(temperature=0.7, max_tokens=5, stop=["\n"], seed=3),
            stream_options=pb.StreamOptions(include_usage=True),  # unary: not sent
            cache_salt="salt",
            routing=pb.RoutingHints(session_id="s-1"),
            extra_json='{"tool_choice": "none"}',
        )
        metadata = (
            ("x-request-id", "req-7"),
            ("authorization", "Bearer t0k"),
            ("x-tenant-id", "acme"),
        )
        call = rig.api.CreateChatCompletion(request, metadata=metadata, timeout=TIMEOUT)
        reply = await call
        assert reply.choices[0].message.content == "tok0 tok1 tok2 "
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage.total_tokens == 8 and not reply.usage.HasField("cached_tokens")
        trailers = dict(await call.trailing_metadata())
        assert trailers == {"x-request-id": "req-7", "x-kvroute-backend": "b0"}
        assert rig.stubs[0].received == [
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hello"},
                ],
                "temperature": 0.7,
                "max_tokens": 5,
                "stop": ["\n"],
                "seed": 3,
                "cache_salt": "salt",
                "stream": False,
                "tool_choice": "none",
            }
        ]
        headers = rig.stubs[0].headers[0]
        assert headers["X-Request-Id"] == "req-7"
        assert headers["Authorization"] == "Bearer t0k"
        assert headers["X-Tenant-Id"] == "acme"
        assert headers["X-Session-Id"] == "s-1"
        assert headers["Content-Type"] == "application/json"
        await settle(rig.router)


async def test_unary_completion_text_and_token_ids() -> None:
    async with grpc_router() as rig:
        reply = await rig.api.CreateCompletion(
            pb.CompletionRequest(model=MODEL, text="once upon"), timeout=TIMEOUT
        )
        assert reply.choices[0].text == "tok0 tok1 tok2 "
        call = rig.api.CreateCompletion(
            pb.CompletionRequest(model=MODEL, token_ids=pb.TokenIds(ids=[1, 2, 3])),
            timeout=TIMEOUT,
        )
        assert (await call).choices[0].finish_reason == "stop"
        assert dict(await call.trailing_metadata())["x-request-id"]  # made up when absent
        assert [r["prompt"] for r in rig.stubs[0].received] == ["once upon", [1, 2, 3]]
        await settle(rig.router)


async def test_streams_chat_and_completion() -> None:
    async with grpc_router() as rig:
        call = rig.api.StreamChatCompletion(
            chat_request(stream_options=pb.StreamOptions(include_usage=True)), timeout=TIMEOUT
        )
        messages = [m async for m in call]
        assert [m.choices[0].delta.content for m in messages[:-1]] == ["tok0 ", "tok1 ", "tok2 "]
        assert not messages[-1].choices and messages[-1].usage.completion_tokens == 3
        assert dict(await call.trailing_metadata())["x-kvroute-backend"] == "b0"
        assert rig.stubs[0].received[-1]["stream"] is True
        assert rig.stubs[0].received[-1]["stream_options"] == {"include_usage": True}

        call = rig.api.StreamCompletion(
            pb.CompletionRequest(model=MODEL, token_ids=pb.TokenIds(ids=[5, 6])),
            timeout=TIMEOUT,
        )
        assert [m.choices[0].text async for m in call] == ["tok0 ", "tok1 ", "tok2 "]
        assert await call.code() == grpc.StatusCode.OK
        await settle(rig.router)


async def _vllm_stream(request: web.Request, body: dict, b, chat: bool) -> web.StreamResponse:
    """vLLM's shapes the stub lacks: role chunk, finish, usage with cached tokens; events
    cut at odd places across writes (the client must still get whole messages)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    model = body["model"]
    events = [
        {"id": "c", "model": model, "created": 1, "choices": [{"index": 0, "delta": d}]}
        for d in ({"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"})
    ]
    events[-1]["choices"][0]["finish_reason"] = "stop"
    usage = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42}
    usage["prompt_tokens_details"] = {"cached_tokens": 32}
    events.append({"id": "c", "model": model, "created": 1, "choices": [], "usage": usage})
    raw = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    for i in range(0, len(raw), 37):
        await response.write(raw[i : i + 37])
    await response.write_eof()
    return response


async def test_trailers_carry_the_reason_and_whether_the_request_queued() -> None:
    limits = {"max_concurrent_requests": 1, "queue_size": 4, "queue_timeout": 30}
    async with grpc_router(limits=limits, flow={"reason_header": True}) as rig:
        rig.stubs[0].behaviour.gate = asyncio.Event()  # the first call holds the only slot
        held = rig.api.CreateChatCompletion(chat_request("held"), timeout=TIMEOUT)
        held_reply = asyncio.ensure_future(held)
        await wait_for(lambda: rig.stubs[0].active == 1)
        waited = rig.api.StreamChatCompletion(chat_request("waited"), timeout=TIMEOUT)
        streamed = asyncio.ensure_future(_drain(waited))
        await wait_for(lambda: rig.router.dispatcher.admission.queued == 1)
        rig.stubs[0].behaviour.gate.set()
        await held_reply
        assert await streamed
        reason = dict(await held.trailing_metadata())["x-kvroute-reason"]
        assert reason and "queued" not in reason  # admitted at once
        assert dict(await waited.trailing_metadata())["x-kvroute-reason"] == f"{reason}; queued"


async def _drain(call) -> list:
    return [m async for m in call]


async def test_stream_decodes_vllm_events_across_chunk_boundaries() -> None:
    async with grpc_router() as rig:
        rig.stubs[0]._stream = _vllm_stream
        messages = [m async for m in rig.api.StreamChatCompletion(chat_request(), timeout=TIMEOUT)]
        assert [m.choices[0].delta.content for m in messages[:3]] == ["", "Hel", "lo"]
        assert messages[0].choices[0].delta.role == "assistant"
        assert messages[2].choices[0].finish_reason == "stop"
        assert not messages[1].choices[0].HasField("finish_reason")
        assert len(messages) == 4 and not messages[3].choices
        assert messages[3].usage.cached_tokens == 32 and messages[3].usage.prompt_tokens == 40
        await settle(rig.router)


async def test_a_pools_renamed_model_answers_under_the_name_asked_for() -> None:
    """A pool's `model_map` sends stub-model as stub-model-awq: the messages name
    stub-model, a stream's events cut at odd places included."""
    stub = await StubBackend(model="stub-model-awq").start()
    stub._stream = _vllm_stream
    backend = {"url": stub.url, "name": "b0", "models": ["stub-model-awq"]}
    pool = {"name": "awq", "priority": 0, "model_map": {MODEL: "stub-model-awq"}}
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "grpc": {"enabled": True, "port": 0},
        "pools": [{**pool, "backends": [backend]}],
    }
    router = Router(build(config))
    try:
        await router.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
            api = pb_grpc.InferenceStub(channel)
            reply = await api.CreateChatCompletion(chat_request(), timeout=TIMEOUT)
            messages = [m async for m in api.StreamChatCompletion(chat_request(), timeout=TIMEOUT)]
    finally:
        await router.stop()
        await stub.stop()
    assert [r["model"] for r in stub.received] == ["stub-model-awq"] * 2
    assert reply.model == MODEL and reply.choices[0].message.content
    assert len(messages) == 4 and {m.model for m in messages} == {MODEL}


async def test_stream_arrives_message_by_message() -> None:
    """Each message reaches the client as the backend sends its event, not at the end."""
    pace, n = 0.2, 5
    async with grpc_router() as rig:
        rig.stubs[0].behaviour.chunks, rig.stubs[0].behaviour.pace = n, pace
        arrivals = []
        async for _ in rig.api.StreamChatCompletion(chat_request(), timeout=TIMEOUT):
            arrivals.append(time.monotonic())
        assert len(arrivals) == n
        lags = [a - s for a, s in zip(arrivals, rig.stubs[0].chunk_sent_at, strict=True)]
        assert max(lags) < pace / 2, lags
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        assert min(gaps) > pace / 2, gaps
        await settle(rig.router)


# ------------------------------------------------------------------ cancellation, deadlines


async def test_cancel_mid_stream_aborts_upstream() -> None:
    async with grpc_router() as rig:
        rig.stubs[0].behaviour.chunks, rig.stubs[0].behaviour.pace = 50, 0.2
        call = rig.api.StreamChatCompletion(chat_request(), timeout=TIMEOUT)
        first = await call.read()
        assert first.choices[0].delta.content == "tok0 "
        call.cancel()
        await wait_for(lambda: rig.stubs[0].aborted == 1)
        assert rig.stubs[0].completed == 0
        await settle(rig.router)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
async def test_client_deadline_aborts_upstream(stream: bool) -> None:
    async with grpc_router() as rig:
        if stream:
            rig.stubs[0].behaviour.chunks, rig.stubs[0].behaviour.pace = 50, 0.2
        else:
            rig.stubs[0].behaviour.delay = 30
        rpc = rig.api.StreamChatCompletion if stream else rig.api.CreateChatCompletion
        with pytest.raises(grpc.aio.AioRpcError) as info:
            call = rpc(chat_request(), timeout=0.5)
            if stream:
                async for _ in call:
                    pass
            else:
                await call
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_for(lambda: rig.stubs[0].aborted == 1)
        assert rig.stubs[0].completed == 0
        await settle(rig.router)


# ------------------------------------------------------------------ errors


def status_details(err: grpc.aio.AioRpcError) -> dict[str, object]:
    """The google.rpc details in the trailers, as {"ErrorInfo": ..., "RetryInfo": ...}."""
    raw = dict(err.trailing_metadata())["grpc-status-details-bin"]
    status = status_pb2.Status.FromString(raw)
    assert status.code == err.code().value[0] and status.message == err.details()
    out = {}
    for any_ in status.details:
        for kind in (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo):
            if any_.Is(kind.DESCRIPTOR):
                message = kind()
                any_.Unpack(message)
                out[kind.__name__] = message
    return out


async def collect(call) -> list:
    """Every message a stream call still has (read() works before and after other reads)."""
    out = []
    while (message := await call.read()) is not grpc.aio.EOF:
        out.append(message)
    return out


async def expect_error(call, code: grpc.StatusCode, text: str = "") -> grpc.aio.AioRpcError:
    """Await a unary call, or drain a stream call; it must fail with `code`."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = await (collect(call) if hasattr(call, "read") else call)
        raise AssertionError(f"expected {code}, got {result}")
    err = info.value
    assert err.code() == code, (err.code(), err.details())
    assert text in err.details()
    return err


@pytest.mark.parametrize(
    ("request_", "text"),
    [
        pytest.param(pb.ChatCompletionRequest(model=MODEL), "`messages`", id="no-messages"),
        pytest.param(chat_request(extra_json="{nope"), "not valid JSON", id="bad-extra-json"),
        pytest.param(chat_request(extra_json='{"model": "x"}'), "model", id="extra-json-clash"),
        pytest.param(
            pb.ChatCompletionRequest(
                model=MODEL,
                messages=[
                    pb.ChatMessage(role="user", content="a", parts=[pb.ContentPart(type="text")])
                ],
            ),
            "both content and parts",
            id="content-and-parts",
        ),
    ],
)
async def test_invalid_argument(request_: pb.ChatCompletionRequest, text: str) -> None:
    async with grpc_router() as rig:
        call = rig.api.CreateChatCompletion(request_, timeout=TIMEOUT)
        err = await expect_error(call, grpc.StatusCode.INVALID_ARGUMENT, text)
        assert status_details(err)["ErrorInfo"].metadata["http_status"] == "400"
        assert rig.stubs[0].received == []
        await settle(rig.router)


#: bytes that are no protobuf message: a field tag whose varint never ends
MALFORMED = b"\xff" * 11


def raw_call(channel: grpc.aio.Channel, path: str, streaming: tuple[bool, bool], metadata):
    """`path` called with MALFORMED as its request (bytes: no serializer)."""
    make = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, True): channel.stream_stream,
    }[streaming]
    request = iter([MALFORMED]) if streaming[0] else MALFORMED
    return make(path)(request, metadata=metadata, timeout=TIMEOUT)


@pytest.mark.parametrize(
    ("path", "streaming", "gated"),
    [
        pytest.param(f"/{SERVICE}/CreateChatCompletion", (False, False), True, id="unary"),
        pytest.param(f"/{SERVICE}/StreamChatCompletion", (False, True), True, id="stream"),
        pytest.param(f"/{SERVICE}/CreateCompletion", (False, False), True, id="completion"),
        pytest.param("/grpc.health.v1.Health/Check", (False, False), False, id="health"),
        pytest.param("/grpc.health.v1.Health/Watch", (False, True), False, id="health-watch"),
        pytest.param(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            (True, True),
            True,
            id="reflection",
        ),
    ],
)
async def test_malformed_message_is_invalid_argument_after_auth(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    path: str,
    streaming: tuple[bool, bool],
    gated: bool,
) -> None:
    """Bytes that do not parse: UNAUTHENTICATED without a token (nothing is parsed for
    a stranger; health is open to all), INVALID_ARGUMENT with one, and no traceback in
    the log either way."""
    monkeypatch.setenv("KVROUTE_TEST_GRPC_TOKENS", "tok-a")
    auth = {"enabled": True, "tokens_env": "KVROUTE_TEST_GRPC_TOKENS"}
    caplog.set_level("DEBUG")
    stranger = grpc.StatusCode.UNAUTHENTICATED if gated else grpc.StatusCode.INVALID_ARGUMENT
    async with grpc_router(auth=auth) as rig:
        for metadata, code in (
            ((), stranger),
            ((("authorization", "Bearer tok-a"),), grpc.StatusCode.INVALID_ARGUMENT),
        ):
            err = await expect_error(raw_call(rig.channel, path, streaming, metadata), code)
            assert status_details(err)["ErrorInfo"].metadata["http_status"] in {"400", "401"}
        assert rig.stubs[0].received == []
        await settle(rig.router)
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


async def test_unknown_model_is_not_found() -> None:
    async with grpc_router() as rig:
        call = rig.api.CreateCompletion(pb.CompletionRequest(model="gpt-nope", text="x"))
        err = await expect_error(call, grpc.StatusCode.NOT_FOUND, "gpt-nope")
        assert status_details(err)["ErrorInfo"].metadata["param"] == "model"
        assert rig.stubs[0].received == []


async def test_no_backend_is_unavailable_with_retry_info() -> None:
    async with grpc_router() as rig:
        rig.router.fleet.set_healthy(rig.router.fleet.members[0], False)
        err = await expect_error(
            rig.api.StreamChatCompletion(chat_request(), timeout=TIMEOUT),
            grpc.StatusCode.UNAVAILABLE,
        )
        assert dict(err.trailing_metadata())["retry-after"] == "1"
        assert status_details(err)["RetryInfo"].retry_delay.seconds == 1


async def test_admission_limit_is_resource_exhausted() -> None:
    async with grpc_router(limits={"max_concurrent_requests": 1, "queue_size": 0}) as rig:
        rig.stubs[0].behaviour.delay = 0.5
        first = rig.api.CreateChatCompletion(chat_request(), timeout=TIMEOUT)
        await wait_for(lambda: rig.stubs[0].active == 1)
        err = await expect_error(
            rig.api.CreateChatCompletion(chat_request(), timeout=TIMEOUT),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
        assert dict(err.trailing_metadata())["retry-after"] == "1"
        assert dict(err.trailing_metadata())["x-kvroute-drop-reason"] == "queue_full"
        assert status_details(err)["RetryInfo"].retry_delay.seconds == 1
        assert (await first).choices
        await settle(rig.router)


async def test_backend_timeout_is_deadline_exceeded() -> None:
    async with grpc_router(timeouts={"first_byte": 0.3}) as rig:
        rig.stubs[0].behaviour.hang_before_headers = True
        err = await expect_error(
            rig.api.CreateChatCompletion(chat_request(), timeout=TIMEOUT),
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "did not answer in time",
        )
        assert dict(err.trailing_metadata())["x-kvroute-backend"] == "b0"  # who failed
        await settle(rig.router)


@pytest.mark.parametrize(
    ("status", "code"),
    [
        pytest.param(400, grpc.StatusCode.INVALID_ARGUMENT, id="400"),
        pytest.param(404, grpc.StatusCode.NOT_FOUND, id="404"),
        pytest.param(500, grpc.StatusCode.INTERNAL, id="500"),
        pytest.param(502, grpc.StatusCode.UNAVAILABLE, id="502"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_backend_error_status(status: int, code: grpc.StatusCode, stream: bool) -> None:
    async with grpc_router() as rig:
        rig.stubs[0].behaviour.status = status
        rpc = rig.api.StreamChatCompletion if stream else rig.api.CreateChatCompletion
        err = await expect_error(rpc(chat_request(), timeout=TIMEOUT), code, "stub failure")
        assert dict(err.trailing_metadata())["x-kvroute-backend"] == "b0"
        await settle(rig.router)


async def test_backend_unreachable_is_unavailable() -> None:
    async with grpc_router() as rig:
        await rig.stubs[0].stop()  # connection refused before the poller notices
        err = await expect_error(
            rig.api.CreateChatCompletion(chat_request(), timeout=TIMEOUT),
            grpc.StatusCode.UNAVAILABLE,
            "connect",
        )
        assert dict(err.trailing_metadata())["x-kvroute-backend"] == "b0"  # who failed
        await settle(rig.router)


async def _stream_then_error(request: web.Request, body: dict, b, chat: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "partial"}}]}
    error = {"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}
    for event in (chunk, error):
        await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def test_in_band_error_event_ends_stream_with_its_status() -> None:
    async with grpc_router() as rig:
        rig.stubs[0]._stream = _stream_then_error
        call = rig.api.StreamChatCompletion(chat_request(), timeout=TIMEOUT)
        assert (await call.read()).choices[0].delta.content == "partial"
        err = await expect_error(call, grpc.StatusCode.INVALID_ARGUMENT, "prompt too long")
        assert dict(err.trailing_metadata())["x-kvroute-backend"] == "b0"
        await settle(rig.router)


async def test_stream_cut_by_backend_is_unavailable_after_messages() -> None:
    async with grpc_router() as rig:
        rig.stubs[0].behaviour.chunks, rig.stubs[0].behaviour.cut_after_chunks = 5, 2
        call = rig.api.StreamChatCompletion(chat_request(), timeout=TIMEOUT)
        got = [(await call.read()).choices[0].delta.content for _ in range(2)]
        assert got == ["tok0 ", "tok1 "]
        await expect_error(call, grpc.StatusCode.UNAVAILABLE, "stream")
        await settle(rig.router)


async def test_stream_open_at_the_drain_deadline_ends_unavailable() -> None:
    """A stream that outlives `shutdown.drain_seconds` ends with UNAVAILABLE, saying the
    router is shutting down (with a retry-after), after the messages sent so far."""
    async with grpc_router(shutdown={"drain_seconds": 0.3}) as rig:
        rig.stubs[0].behaviour.chunks, rig.stubs[0].behaviour.pace = 50, 0.2
        call = rig.api.StreamChatCompletion(chat_request(), timeout=TIMEOUT)
        assert (await call.read()).choices[0].delta.content == "tok0 "
        shutdown = asyncio.create_task(rig.router.shutdown())
        err = await expect_error(call, grpc.StatusCode.UNAVAILABLE, "shutting down")
        assert dict(err.trailing_metadata())["retry-after"] == "1"
        await shutdown
        await wait_for(lambda: rig.stubs[0].aborted == 1)


async def test_auth_applies_to_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    """With auth on, gRPC checks the same bearer tokens; the token's tenant wins."""
    monkeypatch.setenv("KVROUTE_TEST_GRPC_TOKENS", "tok-a acme,tok-b")
    auth = {"enabled": True, "tokens_env": "KVROUTE_TEST_GRPC_TOKENS"}
    async with grpc_router(auth=auth, tenant_header="X-Tenant-Id") as rig:
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            call = rig.api.CreateChatCompletion(chat_request(), metadata=metadata, timeout=TIMEOUT)
            err = await expect_error(call, grpc.StatusCode.UNAUTHENTICATED)
            assert status_details(err)["ErrorInfo"].metadata["http_status"] == "401"
        assert rig.stubs[0].received == []
        metadata = (("authorization", "Bearer tok-a"), ("x-tenant-id", "someone-else"))
        await rig.api.CreateChatCompletion(chat_request(), metadata=metadata, timeout=TIMEOUT)
        headers = rig.stubs[0].headers[-1]
        assert "Authorization" not in headers  # the router's token is not the backend's
        assert headers["X-Tenant-Id"] == "acme"
        await settle(rig.router)


@pytest.mark.parametrize(
    ("trusted", "token", "tenant"),
    [
        pytest.param(False, "tok-b", None, id="untrusted-no-token-tenant"),
        pytest.param(True, "tok-b", "from-metadata", id="trusted-no-token-tenant"),
        pytest.param(True, "tok-a", "acme", id="trusted-token-tenant"),
    ],
)
async def test_with_auth_the_tenant_is_the_tokens_or_trusted_metadata(
    monkeypatch: pytest.MonkeyPatch, trusted: bool, token: str, tenant: str | None
) -> None:
    """With auth on, `routing.tenant` never counts (no gateway vouches for a message
    field); the tenant metadata does only when trusted, and never over a token's own."""
    monkeypatch.setenv("KVROUTE_TEST_GRPC_TOKENS", "tok-a acme,tok-b")
    auth = {"enabled": True, "tokens_env": "KVROUTE_TEST_GRPC_TOKENS"}
    if trusted:
        auth["tenant_header_trusted"] = True
    async with grpc_router(auth=auth, tenant_header="X-Tenant-Id") as rig:
        metadata = (("authorization", f"Bearer {token}"), ("x-tenant-id", "from-metadata"))
        request = chat_request(routing=pb.RoutingHints(tenant="from-the-message"))
        await rig.api.CreateChatCompletion(request, metadata=metadata, timeout=TIMEOUT)
        assert rig.stubs[0].headers[-1].get("X-Tenant-Id") == tenant
        await settle(rig.router)


# ------------------------------------------------------------------ health, reflection


async def test_health_follows_backend_usability() -> None:
    async with grpc_router() as rig:
        health = health_pb2_grpc.HealthStub(rig.channel)
        r = health_pb2.HealthCheckResponse
        for service in ("", SERVICE):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == r.SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=TIMEOUT)
        assert (await watch.read()).status == r.SERVING
        rig.router.fleet.set_healthy(rig.router.fleet.members[0], False)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
        assert reply.status == r.NOT_SERVING
        assert (await watch.read()).status == r.NOT_SERVING
        watch.cancel()
        await expect_error(
            health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5),
            grpc.StatusCode.NOT_FOUND,
        )


def reflection_info(channel: grpc.aio.Channel, version: str):
    """The ServerReflectionInfo method of reflection `version`. v1's messages are
    v1alpha's field for field (only the package differs), so one set of classes encodes
    both, as on the wire."""
    return channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
@pytest.mark.parametrize("auth", [False, True], ids=["auth-off", "auth-on-with-a-token"])
async def test_reflection_lists_the_service(
    monkeypatch: pytest.MonkeyPatch, auth: bool, version: str
) -> None:
    """With auth on, reflection answers a client with a data-plane token (grpcurl -H);
    v1 (what current clients ask first) and v1alpha answer alike."""
    monkeypatch.setenv("KVROUTE_TEST_GRPC_TOKENS", "tok-b")
    config = {"auth": {"enabled": True, "tokens_env": "KVROUTE_TEST_GRPC_TOKENS"}} if auth else {}
    async with grpc_router(**config) as rig:
        v1 = "grpc.reflection.v1.ServerReflection"
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=v1),
        ]
        metadata = (("authorization", "Bearer tok-b"),) if auth else ()
        info = reflection_info(rig.channel, version)(iter(requests), timeout=5, metadata=metadata)
        replies = [r async for r in info]
        names = {s.name for s in replies[0].list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health", v1} <= names
        files = replies[1].file_descriptor_response.file_descriptor_proto
        assert any(b"kvroute/v1/kvroute.proto" in f for f in files)
        files = replies[2].file_descriptor_response.file_descriptor_proto
        assert any(b"grpc/reflection/v1/reflection.proto" in f for f in files)


async def test_refused_reflection_is_unauthenticated_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stranger's reflection stream is refused with UNAUTHENTICATED, never INTERNAL:
    the refusal waits for the client's last write (one that fails on a finished call is
    reported as INTERNAL by grpcio's client)."""
    monkeypatch.setenv("KVROUTE_TEST_GRPC_TOKENS", "tok-b")
    auth = {"enabled": True, "tokens_env": "KVROUTE_TEST_GRPC_TOKENS"}
    async with grpc_router(auth=auth) as rig:
        stub = reflection_pb2_grpc.ServerReflectionStub(rig.channel)
        codes = collections.Counter()
        for _ in range(100):
            call = stub.ServerReflectionInfo(timeout=TIMEOUT)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
                await call.write(reflection_pb2.ServerReflectionRequest(file_by_filename="x"))
                await call.done_writing()
            codes[(await call.code()).name] += 1
        assert codes == {"UNAUTHENTICATED": 100}


# ------------------------------------------------------------------ same routing as HTTP


async def test_same_prompt_same_backend_over_http_and_grpc() -> None:
    """PREFIX_AWARE: HTTP and gRPC requests with one prompt fingerprint alike."""
    async with grpc_router(4, {"strategy": "PREFIX_AWARE"}, tenant_header="X-Tenant-Id") as rig:
        picks = []
        async with aiohttp.ClientSession() as http:
            for i in range(12):
                question, tenant = f"question {i} " * 8, f"t{i % 3}"
                payload = {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": "be brief"},
                        {"role": "user", "content": question},
                    ],
                }
                headers = {"X-Tenant-Id": tenant}
                url = rig.router.url + "/v1/chat/completions"
                async with http.post(url, json=payload, headers=headers) as resp:
                    over_http = resp.headers["x-kvroute-backend"]
                call = rig.api.CreateChatCompletion(
                    chat_request(question), metadata=(("x-tenant-id", tenant),), timeout=TIMEOUT
                )
                await call
                over_grpc = dict(await call.trailing_metadata())["x-kvroute-backend"]
                ids = list(range(i, i + 40))
                url = rig.router.url + "/v1/completions"
                async with http.post(url, json={"model": MODEL, "prompt": ids}) as resp:
                    ids_http = resp.headers["x-kvroute-backend"]
                call = rig.api.CreateCompletion(
                    pb.CompletionRequest(model=MODEL, token_ids=pb.TokenIds(ids=ids)),
                    timeout=TIMEOUT,
                )
                await call
                ids_grpc = dict(await call.trailing_metadata())["x-kvroute-backend"]
                picks.append((over_http, over_grpc, ids_http, ids_grpc))
        assert all(a == b and c == d for a, b, c, d in picks), picks
        assert len({p[0] for p in picks}) > 1, picks  # the prompts did spread over backends
        await settle(rig.router)


async def test_grpc_requests_are_accounted_like_http() -> None:
    async with grpc_router() as rig:
        await rig.api.CreateChatCompletion(chat_request(), timeout=TIMEOUT)
        async with aiohttp.ClientSession() as http, http.get(rig.router.url + "/metrics") as resp:
            text = await resp.text()
        labels = ("backend", "status", "endpoint", "model")
        samples = {
            (s.name, *(s.labels.get(k) for k in labels)): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert samples[("kvroute_requests_total", "b0", "200", "chat", MODEL)] == 1
        assert (
            samples[("kvroute_e2e_request_latency_seconds_count", "b0", None, "chat", MODEL)] == 1
        )


async def test_capture_records_the_clients_metadata_as_sent(tmp_path) -> None:
    """The record holds the metadata the client sent (a binary value in base64, as it
    travels), not the headers the router made up for the backend."""
    capture = {"enabled": True, "sample": 1.0, "path": str(tmp_path)}
    metadata = (
        ("authorization", "Bearer t0k"),
        ("x-team", "search"),
        ("x-tenant-id", "acme"),
        ("trace-bin", b"\x00\xfe\xff"),
    )
    async with grpc_router(tenant_header="X-Tenant-Id", capture=capture) as rig:
        request = chat_request(routing=pb.RoutingHints(session_id="s-1"))
        await rig.api.CreateChatCompletion(request, metadata=metadata, timeout=TIMEOUT)
        stream = rig.api.StreamChatCompletion(request, metadata=metadata, timeout=TIMEOUT)
        assert await collect(stream)
        assert rig.stubs[0].headers[0]["X-Session-Id"] == "s-1"  # the backend's, not recorded
    files = sorted(tmp_path.iterdir())
    records = [orjson.loads(x) for f in files for x in f.read_bytes().splitlines()]
    assert len(records) == 2
    for record in records:
        headers = {k.lower(): v for k, v in record["headers"].items()}
        assert headers["x-team"] == "search" and headers["x-tenant-id"] == "acme"
        assert headers["authorization"] == "[redacted]"
        assert headers["trace-bin"] == "AP7/"
        assert not headers.keys() & {"x-request-id", "x-session-id", "content-type"}
