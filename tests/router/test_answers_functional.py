"""What clients are answered, over raw sockets: every error in OpenAI-style JSON with
nothing of the client's bytes or the router's libraries in it, no `Server` header on
any listener, and an answer for a client that half-closed after its request."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from tests.router.conftest import running, settle
from tests.router.test_fast_ingress_functional import ANSWER, BODY, STREAM, ask, post, read_response

ADMIN_TOKEN = "admin-token-for-answers"
GZIP_LIE = post(b"not gzip at all", extra="Content-Encoding: gzip\r\n")
MALFORMED = b"GET /v1/models HTTP/1.1\r\nHost: k\r\nBad Header\x01: <script>\r\n\r\n"


@pytest.fixture
def admin(monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setenv("KV_ANSWERS_ADMIN", ADMIN_TOKEN)
    return {"port": 0, "token_env": "KV_ANSWERS_ADMIN"}


DATA = [
    pytest.param(post(), 200, id="fast-path"),
    pytest.param(post(STREAM), 200, id="fast-path-stream"),
    pytest.param(b"GET /v1/models HTTP/1.1\r\nHost: k\r\n\r\n", 200, id="aiohttp"),
    pytest.param(post(path="/v1/chat/completions?s=1"), 200, id="aiohttp-proxied"),
    pytest.param(b"GET /nothing HTTP/1.1\r\nHost: k\r\n\r\n", 404, id="unknown-path"),
    pytest.param(b"GET /v1/chat/completions HTTP/1.1\r\nHost: k\r\n\r\n", 405, id="method"),
    pytest.param(MALFORMED, 400, id="malformed"),
    pytest.param(GZIP_LIE, 400, id="not-gzip"),
    pytest.param(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: k\r\nExpect: 100-continue\r\n"
        b"Content-Length: 99999999\r\n\r\n",
        413,
        id="413",
    ),
    pytest.param(post(extra="X-Big: " + "a" * 20000 + "\r\n"), 431, id="431"),
]
ADMIN = [
    pytest.param(b"GET /admin/config HTTP/1.1\r\nHost: k\r\n\r\n", 401, id="admin-401"),
    pytest.param(
        b"GET /admin/config HTTP/1.1\r\nHost: k\r\nAuthorization: Bearer %s\r\n\r\n"
        % ADMIN_TOKEN.encode(),
        200,
        id="admin-200",
    ),
    pytest.param(MALFORMED.replace(b"/v1/models", b"/admin/config"), 400, id="admin-malformed"),
]


@pytest.mark.parametrize(("request_", "status"), DATA + ADMIN)
async def test_no_answer_names_the_server_software_and_errors_are_json(
    request_: bytes, status: int, admin: dict
) -> None:
    async with running(1, admin=admin) as (router, _):
        port = router.admin.port if request_.startswith(b"GET /admin/") else router.port
        got, headers, body = await ask(port, request_)
        assert got == status
        assert "server" not in headers
        if status >= 400:
            assert headers["content-type"] == "application/json"
            error = orjson.loads(body)["error"]
            assert error["code"] == status
            assert "script" not in error["message"] and "aaaa" not in error["message"]


async def test_a_body_that_is_not_its_content_encoding_is_a_plain_400_not_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with running(1) as (router, stubs):
        status, _, body = await ask(router.port, GZIP_LIE)
        assert status == 400
        message = orjson.loads(body)["error"]["message"]
        assert message == "The request body is not valid gzip, as its Content-Encoding says."
        assert stubs[0].received == []
        await settle(router)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in caplog.records if r.exc_info]
    details = [r.getMessage() for r in caplog.records if r.name == "kvroute.http"]
    assert any("Can not decode content-encoding" in d for d in details), details


async def test_a_backend_that_breaks_off_is_told_in_plain_words_and_logged_in_full(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="kvroute")
    async with running(1) as (router, stubs):
        stubs[0].behaviour.chunks, stubs[0].behaviour.cut_after_chunks = 5, 2
        status, _, body = await ask(router.port, post(STREAM))
        assert status == 200
        events = [e for e in body.split(b"\n\n") if e.startswith(b"data: {")]
        error = orjson.loads(events[-1][6:])["error"]
        assert error["message"] == f"Backend b0 (127.0.0.1:{stubs[0].port}) broke off the stream."
        await settle(router)
    details = [r.getMessage() for r in caplog.records if r.name == "kvroute.backends"]
    assert any("TransferEncodingError" in d for d in details), details


HALF_CLOSED = [
    pytest.param(post(), b'"content": "tok0 tok1 tok2 "', id="fast-path"),
    pytest.param(post(STREAM), b"data: [DONE]\n\n", id="fast-path-stream"),
    pytest.param(b"GET /v1/models HTTP/1.1\r\nHost: k\r\n\r\n", b'"stub-model"', id="aiohttp"),
    pytest.param(
        post(STREAM, path="/v1/chat/completions?s=1"), b"data: [DONE]\n\n", id="aiohttp-stream"
    ),
]


@pytest.mark.parametrize(("request_", "expected"), HALF_CLOSED)
async def test_a_client_that_half_closes_after_its_request_gets_the_answer(
    request_: bytes, expected: bytes
) -> None:
    """HTTP lets a client shut its sending side once the request is out: the router
    answers it, then closes."""
    async with running(1) as (router, stubs):
        stubs[0].behaviour.pace = 0.05  # the stream is still going when the EOF comes
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        try:
            async with asyncio.timeout(10):
                writer.write(request_)
                writer.write_eof()
                status, _, body = await read_response(reader)
                assert await reader.read() == b""  # then the router closed
        finally:
            writer.close()
        assert status == 200 and expected in body
        await settle(router)


async def test_a_half_close_before_the_body_is_whole_is_not_answered_as_a_request() -> None:
    async with running(1) as (router, stubs):
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        try:
            async with asyncio.timeout(10):
                writer.write(post()[: -len(BODY) // 2])
                writer.write_eof()
                assert await reader.read() == b""
        finally:
            writer.close()
        assert stubs[0].received == []


async def test_a_half_closed_client_waiting_long_is_asked_if_it_still_listens() -> None:
    """While a slow answer is prepared, the client that half-closed hears `100 Continue`
    now and then (a client that went away answers one with a reset, and its request is
    dropped); then the answer, and the close."""
    async with running(1) as (router, stubs):
        stubs[0].behaviour.delay = 1.0
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        try:
            async with asyncio.timeout(10):
                writer.write(post())
                writer.write_eof()
                interim = 0
                while (head := await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 "):
                    interim += 1
                assert head.startswith(b"HTTP/1.1 200 ")
                assert b"Connection: close" in head
                assert ANSWER in await reader.read()
        finally:
            writer.close()
        assert interim >= 1
        assert stubs[0].completed == 1
