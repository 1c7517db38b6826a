"""The fast path (router/ingress/fast.py) and its hand-over to aiohttp, on raw sockets.

Every request below must get the same answer whichever server reads it: complete common
POSTs are answered by the fast path, anything else (split heads, late bodies, chunked or
gzip bodies, Expect, pipelining, HTTP/1.0, other paths) by aiohttp after the hand-over,
on the same connection.
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import socket

import orjson
import pytest

from router.ingress.fast import PIPELINED_BYTES, FastConnection
from router.upstream.connection import _Connection
from tests.router.conftest import running, settle

BODY = orjson.dumps({"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]})
STREAM = orjson.dumps(
    {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
)
ANSWER = b'"content": "tok0 tok1 tok2 "'


def post(body: bytes = BODY, path: str = "/v1/chat/completions", extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: kvroute\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer: status, headers (lower-case names), body (chunked decoded);
    a 100 Continue before it is skipped."""
    head = await reader.readuntil(b"\r\n\r\n")
    if head.startswith(b"HTTP/1.1 100 "):
        head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readuntil(b"\r\n")
        return status, headers, body
    return status, headers, await reader.readexactly(int(headers.get("content-length", 0)))


async def ask(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request on its own connection, and its answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(10):
            writer.write(request)
            return await read_response(reader)
    finally:
        writer.close()


async def exchange(url: str, *writes: bytes, answers: int = 1, pause: float = 0.05) -> list:
    """Send `writes` (pausing between them) on one connection and read `answers` answers."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        async with asyncio.timeout(10):
            for i, data in enumerate(writes):
                if i:
                    await asyncio.sleep(pause)
                writer.write(data)
                await writer.drain()
            return [await read_response(reader) for _ in range(answers)]
    finally:
        writer.close()


async def test_a_complete_request_is_answered_without_aiohttp(handovers) -> None:
    async with running(1) as (router, stubs):
        (answer,) = await exchange(router.url, post())
        status, headers, body = answer
        assert status == 200 and ANSWER in body
        assert headers["x-kvroute-backend"] == "b0" and headers["x-request-id"]
        assert stubs[0].raw[-1] == BODY
        assert handovers == []


@pytest.mark.parametrize(
    "writes",
    [
        pytest.param((post()[:20], post()[20:]), id="head-split"),
        pytest.param((post(path="/v1/chat/completions?x=1"),), id="query"),
        pytest.param((post().replace(b"HTTP/1.1", b"HTTP/1.0", 1),), id="http-1.0"),
        pytest.param((post(extra="Expect: 100-continue\r\n"),), id="expect"),
        pytest.param(
            (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: k\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),
            ),
            id="chunked",
        ),
    ],
)
async def test_what_the_fast_path_does_not_take_aiohttp_answers_the_same(
    writes: tuple[bytes, ...], handovers
) -> None:
    async with running(1) as (router, stubs):
        (answer,) = await exchange(router.url, *writes)
        assert answer[0] == 200 and ANSWER in answer[2]
        assert stubs[0].raw[-1] == BODY  # the backend got the body, de-chunked
        assert handovers and handovers[0] == writes[0]


async def test_a_body_written_apart_from_its_head_is_waited_for(handovers) -> None:
    """As clients that write the head and the body separately (urllib3) do."""
    async with running(1) as (router, stubs):
        whole = post()
        head = whole[: whole.index(b"\r\n\r\n") + 4]
        rest = whole[len(head) :]
        (answer,) = await exchange(router.url, head, rest[:10], rest[10:])
        assert answer[0] == 200 and ANSWER in answer[2]
        assert stubs[0].raw[-1] == BODY
        assert handovers == []


async def test_a_gzip_body_is_decoded_by_aiohttp(handovers) -> None:
    async with running(1) as (router, stubs):
        packed = gzip.compress(BODY)
        (answer,) = await exchange(router.url, post(packed, extra="Content-Encoding: gzip\r\n"))
        assert answer[0] == 200 and stubs[0].raw[-1] == BODY
        assert len(handovers) == 1


async def test_keep_alive_runs_fast_requests_then_hands_over_for_good(handovers) -> None:
    async with running(1) as (router, stubs):
        split = post()
        answers = await exchange(
            router.url, post(), post(STREAM), split[:30], split[30:], post(), answers=4
        )
        assert [a[0] for a in answers] == [200] * 4
        assert answers[1][1]["transfer-encoding"] == "chunked"
        assert answers[1][2].endswith(b"data: [DONE]\n\n")
        assert ANSWER in answers[3][2]
        assert len(handovers) == 1  # the split request; aiohttp kept the connection after it
        assert len(stubs[0].raw) == 4


async def test_pipelined_requests_are_answered_in_order(handovers) -> None:
    async with running(1) as (router, _stubs):
        answers = await exchange(router.url, post() + post(STREAM), answers=2)
        assert [a[0] for a in answers] == [200, 200]
        assert ANSWER in answers[0][2] and answers[1][2].endswith(b"data: [DONE]\n\n")
        assert len(handovers) == 1


async def test_a_pipelined_request_split_across_reads_is_not_lost(handovers) -> None:
    async with running(1) as (router, stubs):
        second = post(STREAM)
        answers = await exchange(router.url, post() + second[:40], second[40:], answers=2)
        assert [a[0] for a in answers] == [200, 200]
        assert answers[1][2].endswith(b"data: [DONE]\n\n")
        assert len(stubs[0].raw) == 2 and len(handovers) == 1


async def test_a_request_sent_before_the_last_answer_waits_for_it(handovers) -> None:
    async with running(1) as (router, stubs):
        stubs[0].behaviour.chunks, stubs[0].behaviour.pace = 5, 0.05
        answers = await exchange(router.url, post(STREAM), post(), answers=2, pause=0.02)
        assert [a[0] for a in answers] == [200, 200]
        assert answers[0][2].endswith(b"data: [DONE]\n\n")
        assert b'tok4 "}, "finish_reason": "stop"' in answers[1][2]
        assert handovers == []  # the early request was kept and served after the stream


async def test_bytes_pipelined_behind_a_stream_stay_bounded_and_are_served(handovers) -> None:
    """A client that sends a large request behind a running stream: the connection
    stops reading at PIPELINED_BYTES (plus one read), outside the body budget nothing
    more is held, and the pipelined request is served whole once the stream is over."""
    content = "x" * 1_000_000  # the stub backend's own limit is 1 MiB
    big = orjson.dumps({"model": "stub-model", "messages": [{"role": "user", "content": content}]})
    second = post(big)
    async with running(1) as (router, stubs):
        gate = stubs[0].behaviour.chunk_gate = asyncio.Semaphore(0)
        host, port = router.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            async with asyncio.timeout(30):
                writer.write(post(STREAM))
                await reader.readuntil(b"\r\n\r\n")  # the stream runs, held after its first event
                writer.write(second)  # not drained: the router reads what it will
                (conn,) = [o for o in gc.get_objects() if isinstance(o, FastConnection) and o.task]
                while not conn.reading_paused and conn.pipelined < len(second):
                    await asyncio.sleep(0.01)
                assert conn.reading_paused
                assert conn.pipelined < PIPELINED_BYTES + 256 * 1024  # one read at most more
                for _ in range(stubs[0].behaviour.chunks):
                    gate.release()
                while b"data: [DONE]" not in await reader.readuntil(b"\r\n"):
                    pass
                await reader.readuntil(b"0\r\n\r\n")
                status, _, body = await read_response(reader)
        finally:
            writer.close()
        assert status == 200 and ANSWER in body
        assert stubs[0].raw[-1] == big
        assert handovers == []
        await settle(router)


async def test_errors_are_openai_json_from_the_fast_path(handovers) -> None:
    async with running(1) as (router, _stubs):
        unknown = orjson.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]})
        bad = b"{not json"
        answers = [(await exchange(router.url, post(b)))[0] for b in (bad, unknown)]
        assert [a[0] for a in answers] == [400, 404]
        for _status, headers, body in answers:
            assert headers["content-type"] == "application/json"
            assert orjson.loads(body)["error"]["message"]
        assert handovers == []


async def test_connection_close_and_idle_connections_are_closed(handovers) -> None:
    async with running(1, limits={"header_timeout": 0.3}) as (router, _stubs):
        host, port = router.url.removeprefix("http://").split(":")
        for extra in ("Connection: close\r\n", ""):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                async with asyncio.timeout(5):
                    writer.write(post(extra=extra))
                    status, headers, _ = await read_response(reader)
                    assert status == 200
                    assert headers.get("connection") == ("close" if extra else None)
                    assert await reader.read() == b""  # closed: at once, or once idle
            finally:
                writer.close()
        assert handovers == []
        await settle(router)


async def test_a_client_that_stops_reading_holds_the_backend_back_and_loses_nothing() -> None:
    """Flow control through the relay: while the client reads nothing, the router stops
    reading the backend (its socket paused, a bounded body buffer); then every event
    arrives, in order."""
    chunks = 40_000  # ~7 MB: more than the socket buffers on the way hold
    async with running(1) as (router, stubs):
        stubs[0].behaviour.chunks = chunks
        host, port = router.url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            writer.write(post(STREAM))
            async with asyncio.timeout(5):
                while not stubs[0].chunk_sent_at:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)  # the client reads nothing meanwhile
            (upstream,) = [
                o for o in gc.get_objects() if isinstance(o, _Connection) and o.relay is not None
            ]
            (client,) = [o for o in gc.get_objects() if isinstance(o, FastConnection) and o.task]
            assert not upstream.transport.is_reading()  # the backend waits
            assert client.writing_paused  # the router's buffer for the client is full...
            assert client.transport.get_write_buffer_size() < 1_000_000  # ...and bounded
            async with asyncio.timeout(60):
                status, _, body = await read_response(reader)
        finally:
            writer.close()
        assert status == 200
        events = body.split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        contents = [orjson.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-2]]
        assert contents == [f"tok{i} " for i in range(chunks)]
        assert stubs[0].completed == 1
        await settle(router)


async def test_a_body_that_does_not_come_is_a_408_and_the_connection_closes(handovers) -> None:
    async with running(1, limits={"body_timeout": 0.3}) as (router, stubs):
        host, port = router.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            async with asyncio.timeout(5):
                writer.write(post()[:-5])  # five bytes short, for good
                status, headers, body = await read_response(reader)
                assert status == 408 and headers["connection"] == "close"
                assert "did not arrive within 0.3 s" in orjson.loads(body)["error"]["message"]
                assert await reader.read() == b""
        finally:
            writer.close()
        assert stubs[0].received == [] and handovers == []
