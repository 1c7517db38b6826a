"""What the router forwards, seen from a raw socket backend: the request target in
origin-form with its dot segments resolved, no hop-by-hop headers either way, and a
request id that is a bounded token."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest

from router.config import build
from router.control.worker import Router
from tests.raw_backend import RawBackend, json_answer
from tests.router.test_fast_ingress_functional import BODY, ask, read_response
from tests.router.test_grpc_functional import TIMEOUT, chat_request, grpc_router

FRESH_ID = re.compile(r"[0-9a-f]{32}")


@asynccontextmanager
async def routed(
    backend: RawBackend | None = None, **config: Any
) -> AsyncIterator[tuple[Router, RawBackend]]:
    """A router in front of a raw backend (started and stopped here)."""
    backend = await (backend or RawBackend()).start()
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": backend.url, "name": "b0"}],
        **config,
    }
    router = Router(build(data))
    try:
        await router.start()
        yield router, backend
    finally:
        await router.stop()
        await backend.stop()


def raw_post(target: str, extra: str = "", body: bytes = BODY) -> bytes:
    head = f"POST {target} HTTP/1.1\r\nHost: kvroute\r\nContent-Type: application/json\r\n"
    return f"{head}{extra}Content-Length: {len(body)}\r\n\r\n".encode() + body


@pytest.mark.parametrize(
    ("target", "forwarded"),
    [
        pytest.param("/v2/models", "/v2/models", id="plain"),
        pytest.param("/v2/a/../models?x=/../y", "/v2/models?x=/../y", id="dots-query-kept"),
        pytest.param("/v1/audio/./speech/.", "/v1/audio/speech/", id="single-dots"),
        pytest.param("/v2/a/%2e%2E/b", "/v2/b", id="encoded-dots"),
        pytest.param("http://other:9/v2/models?x=1", "/v2/models?x=1", id="absolute-form"),
        pytest.param("HTTP://other/v1/responses/r1", "/v1/responses/r1", id="absolute-upper"),
        pytest.param(
            "http://other/v1/chat/completions", "/v1/chat/completions", id="absolute-generation"
        ),
    ],
)
async def test_the_backend_gets_the_normalised_origin_form(target: str, forwarded: str) -> None:
    async with routed() as (router, backend):
        status, _, _ = await ask(router.port, raw_post(target))
        assert status == 200
        (received,) = backend.proxied()
        assert received.target == forwarded.encode()


@pytest.mark.parametrize(
    ("target", "says"),
    [
        pytest.param("/v2/../admin", "outside /v2/", id="dot-dot"),
        pytest.param("/v2/a/../../admin", "outside /v2/", id="deeper"),
        pytest.param("/v1/audio/%2E%2e/%2e%2e/admin", "outside /v1/audio/", id="encoded-dots"),
        pytest.param("http://other/v2/../../admin", "outside /v2/", id="absolute-form"),
        pytest.param("/v2/..%2Fadmin", "encoded slash", id="encoded-slash"),
        pytest.param("/v2/..%5cadmin", "encoded slash", id="encoded-backslash"),
    ],
)
async def test_a_path_that_escapes_its_route_is_refused(target: str, says: str) -> None:
    async with routed() as (router, backend):
        status, headers, body = await ask(router.port, raw_post(target))
        assert status == 400 and headers["content-type"] == "application/json"
        assert says in orjson.loads(body)["error"]["message"]
        assert backend.proxied() == []


@pytest.mark.parametrize(
    "target", ["/v1/chat/completions", "/v2/models"], ids=["fast-path", "aiohttp"]
)
async def test_hop_by_hop_headers_stop_at_the_router(target: str) -> None:
    """RFC 9110 §7.6.1: the fields the Connection header names, and Expect (the router
    answered it), are not forwarded; in the answer neither are the backend's."""
    answer = json_answer(extra=b"Connection: X-Backend-Secret\r\nX-Backend-Secret: s\r\n")
    async with routed(RawBackend(answer)) as (router, backend):
        extra = (
            "Authorization: Bearer for-the-router\r\nX-Hop: 1\r\nX-Kept: 2\r\n"
            "Connection: keep-alive, Authorization\r\nConnection: x-hop\r\n"
        )
        status, headers, _ = await ask(router.port, raw_post(target, extra))
        assert status == 200
        assert "x-backend-secret" not in headers
        expecting = raw_post(target, "Expect: 100-continue\r\n")
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        try:
            async with asyncio.timeout(10):
                head, body = expecting.split(b"\r\n\r\n")
                writer.write(head + b"\r\n\r\n")
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 ")
                writer.write(body)
                assert (await read_response(reader))[0] == 200
        finally:
            writer.close()
        first, second = backend.proxied()
        assert first.named(b"x-kept") == [b"2"]
        for name in (b"authorization", b"x-hop", b"connection", b"keep-alive"):
            assert first.named(name) == [], name
        assert second.named(b"expect") == []


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param("\u20ac-rid".encode(), id="non-ascii"),
        pytest.param(b"a b", id="space"),
        pytest.param(b"a\tb", id="tab"),
        pytest.param(b"x" * 129, id="too-long"),
        pytest.param(b'"quoted"', id="not-a-token"),
    ],
)
@pytest.mark.parametrize(
    "target", ["/v1/chat/completions", "/v2/models"], ids=["fast-path", "aiohttp"]
)
async def test_a_request_id_that_is_not_a_bounded_token_is_replaced(
    sent: bytes, target: str
) -> None:
    async with routed() as (router, backend):
        request = raw_post(target).replace(b"\r\n\r\n", b"\r\nX-Request-Id: %s\r\n\r\n" % sent)
        status, headers, _ = await ask(router.port, request)
        assert status == 200
        assert FRESH_ID.fullmatch(headers["x-request-id"])
        (received,) = backend.proxied()
        assert received.named(b"x-request-id") == [headers["x-request-id"].encode()]


async def test_a_token_request_id_is_kept() -> None:
    async with routed() as (router, backend):
        rid = "Trace-1.2_3~!#$%&'*+^`|" + "x" * 105  # every token char kind, 128 long
        status, headers, _ = await ask(
            router.port, raw_post("/v1/chat/completions", f"X-Request-Id: {rid}\r\n")
        )
        assert status == 200 and headers["x-request-id"] == rid
        assert backend.proxied()[0].named(b"x-request-id") == [rid.encode()]


@pytest.mark.parametrize("sent", ["a b", "x" * 129, "ok-id"], ids=["space", "too-long", "token"])
async def test_grpc_replaces_a_request_id_that_is_not_a_bounded_token(sent: str) -> None:
    async with grpc_router() as rig:
        metadata = (("x-request-id", sent),)
        call = rig.api.CreateChatCompletion(chat_request(), metadata=metadata, timeout=TIMEOUT)
        await call
        rid = dict(await call.trailing_metadata())["x-request-id"]
        assert rid == sent if sent == "ok-id" else FRESH_ID.fullmatch(rid)
        assert rig.stubs[0].headers[0]["X-Request-Id"] == rid
