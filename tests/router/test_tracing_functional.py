"""Traces, as a vLLM fleet's operator follows one: a client's W3C `traceparent` reaches
the backend in the same trace, its parent the router's attempt span; the spans carry the
GenAI attributes; an unsampled or untraced request costs no span and passes its header
untouched; and the spans reach a real OTLP/HTTP receiver on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import grpc
import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from proto.kvroute.v1 import kvroute_pb2 as pb
from proto.kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from router.config import build
from router.control.worker import Router
from router.dispatch.tracing import parent_sampled
from tests.router.conftest import until_tried_on
from tests.stub_backend import Behaviour, StubBackend

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}


@asynccontextmanager
async def _router(
    *stubs: StubBackend, exporter=None, grpc_port: bool = False, **tracing
) -> AsyncIterator[Router]:
    """A router in front of `stubs` with tracing on (`tracing`: its settings), spans
    to `exporter` if given; `grpc_port`: with the gRPC ingress too."""
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": s.url, "name": f"b{i}"} for i, s in enumerate(stubs)],
        "routing": {"strategy": "RANDOM"},
        "access_log": {"enabled": False},
        "tracing": {"enabled": True, **tracing},
        "grpc": {"enabled": grpc_port, "port": 0},
    }
    router = Router(build(data), span_exporter=exporter)
    await router.start()
    try:
        yield router
    finally:
        await router.stop()  # exports the spans still buffered


async def _post(router: Router, headers: dict[str, str], body: dict = CHAT) -> int:
    async with aiohttp.ClientSession() as http:
        url = router.url + "/v1/chat/completions"
        async with http.post(url, json=body, headers=headers) as resp:
            await resp.read()
            return resp.status


def _parts(traceparent: str) -> tuple[str, str, str]:
    version, trace_id, parent, flags = traceparent.split("-")
    assert version == "00"
    return trace_id, parent, flags


async def test_a_sampled_trace_continues_through_the_router_to_the_backend() -> None:
    stub = await StubBackend().start()
    exporter = InMemorySpanExporter()
    try:
        async with _router(stub, exporter=exporter) as router:
            async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none") as client:
                headers = {"traceparent": f"00-{TRACE}-{PARENT}-01", "tracestate": "vendor=1"}
                await client.chat.completions.create(**CHAT, extra_headers=headers)
    finally:
        await stub.stop()
    (sent,) = stub.headers
    trace_id, backend_parent, flags = _parts(sent["traceparent"])
    assert trace_id == TRACE and flags == "01" and backend_parent != PARENT
    assert sent["tracestate"] == "vendor=1"
    spans = {
        span.kind: span for span in exporter.get_finished_spans() if span.name != "kvroute.route"
    }
    (route,) = [s for s in exporter.get_finished_spans() if s.name == "kvroute.route"]
    server, client_span = spans[SpanKind.SERVER], spans[SpanKind.CLIENT]
    assert server.name == "chat stub-model"
    assert f"{server.context.trace_id:032x}" == TRACE
    assert f"{server.parent.span_id:016x}" == PARENT and server.parent.is_remote
    assert f"{client_span.context.span_id:016x}" == backend_parent  # vLLM's parent
    assert client_span.parent.span_id == route.parent.span_id == server.context.span_id
    attrs = server.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "stub-model"
    assert attrs["gen_ai.usage.input_tokens"] == 5 and attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["http.response.status_code"] == 200 and attrs["kvroute.backend"] == "b0"
    assert (
        route.attributes["kvroute.strategy"] == "RANDOM"
        and route.attributes["kvroute.route.reason"]
    )
    assert route.attributes["kvroute.priority"] == "standard"
    assert route.attributes["kvroute.queue_wait_ms"] >= 0
    assert client_span.attributes["server.port"] == stub.port
    assert server.start_time <= route.start_time <= client_span.start_time
    assert client_span.end_time <= server.end_time
    assert server.resource.attributes["service.name"] == "kvroute"


async def test_unsampled_and_untraced_requests_cost_no_span_and_keep_their_header() -> None:
    stub = await StubBackend().start()
    exporter = InMemorySpanExporter()
    unsampled = f"00-{TRACE}-{PARENT}-00"
    try:
        async with _router(stub, exporter=exporter, sample_ratio=0.0) as router:
            assert await _post(router, {"traceparent": unsampled}) == 200
            assert await _post(router, {}) == 200  # no parent, and the ratio says no
    finally:
        await stub.stop()
    first, second = stub.headers
    assert first["traceparent"] == unsampled and "traceparent" not in second
    assert exporter.get_finished_spans() == ()


async def test_with_tracing_off_the_header_passes_untouched() -> None:
    stub = await StubBackend().start()
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": stub.url}],
        "access_log": {"enabled": False},
    }
    router = Router(build(data))
    await router.start()
    try:
        sampled = f"00-{TRACE}-{PARENT}-01"
        assert await _post(router, {"traceparent": sampled, "tracestate": "a=b"}) == 200
    finally:
        await router.stop()
        await stub.stop()
    (sent,) = stub.headers
    assert sent["traceparent"] == sampled and sent["tracestate"] == "a=b"


async def test_a_new_trace_starts_without_a_parent_and_a_retry_is_a_failed_attempt() -> None:
    failing = await StubBackend(behaviour=Behaviour(status=503)).start()
    good = await StubBackend().start()
    exporter = InMemorySpanExporter()
    try:
        async with _router(failing, good, exporter=exporter) as router:
            statuses = await until_tried_on(failing, lambda: _post(router, {}))
    finally:
        await failing.stop()
        await good.stop()
    assert set(statuses) == {200}
    servers = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert all(s.parent is None for s in servers)  # each started its own trace
    retried = [s for s in servers if s.attributes["kvroute.retries"] == 1]
    assert len(retried) == 1
    tid = retried[0].context.trace_id
    attempts = [
        s
        for s in exporter.get_finished_spans()
        if s.kind is SpanKind.CLIENT and s.context.trace_id == tid
    ]
    assert [a.attributes["kvroute.backend"] for a in attempts] == ["b0", "b1"]
    assert attempts[0].status.status_code is StatusCode.ERROR
    assert attempts[0].attributes["http.response.status_code"] == 503
    (sent,) = failing.headers
    assert _parts(sent["traceparent"])[0] == f"{tid:032x}"


@pytest.mark.parametrize(
    ("header", "sampled"),
    [
        (f"00-{TRACE}-{PARENT}-01", True),
        (f"00-{TRACE}-{PARENT}-00", False),
        (f"00-{'0' * 32}-{PARENT}-01", None),  # an all-zero trace id is invalid
        (f"00-{TRACE.upper()}-{PARENT}-01", None),  # W3C ids are lowercase hex
        ("garbage", None),
        (None, None),
    ],
)
def test_which_traceparent_decides(header, sampled) -> None:
    assert parent_sampled(header) is sampled


async def test_spans_reach_a_real_otlp_receiver_on_loopback() -> None:
    received: list[ExportTraceServiceRequest] = []
    got = asyncio.Event()

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        received.append(message)
        got.set()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    stub = await StubBackend().start()
    try:
        endpoint = f"http://127.0.0.1:{port}/v1/traces"
        async with _router(stub, otlp_endpoint=endpoint, service_name="edge-router") as router:
            assert await _post(router, {"traceparent": f"00-{TRACE}-{PARENT}-01"}) == 200
        await asyncio.wait_for(got.wait(), 10)  # stop() flushed the exporter's batch
    finally:
        await stub.stop()
        await runner.cleanup()
    spans = [
        (resource, span)
        for message in received
        for resource in message.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    names = {span.name for _, span in spans}
    assert {"chat stub-model", "kvroute.route", "POST"} <= names
    assert all(span.trace_id.hex() == TRACE for _, span in spans)
    service = {
        a.value.string_value
        for r, _ in spans
        for a in r.resource.attributes
        if a.key == "service.name"
    }
    assert service == {"edge-router"}


async def test_a_grpc_clients_trace_context_reaches_the_backend() -> None:
    stub = await StubBackend().start()
    exporter = InMemorySpanExporter()
    try:
        async with _router(stub, exporter=exporter, grpc_port=True) as router:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
                api = pb_grpc.InferenceStub(channel)
                request = pb.ChatCompletionRequest(
                    model="stub-model", messages=[pb.ChatMessage(role="user", content="hi")]
                )
                metadata = (("traceparent", f"00-{TRACE}-{PARENT}-01"),)
                await api.CreateChatCompletion(request, metadata=metadata, timeout=10)
    finally:
        await stub.stop()
    (sent,) = stub.headers
    assert _parts(sent["traceparent"])[0] == TRACE
    (server,) = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert f"{server.parent.span_id:016x}" == PARENT
