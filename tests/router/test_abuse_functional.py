"""Hostile clients over raw sockets: slowloris headers and bodies, oversize bodies, header
floods, bursts beyond the admission queue. The router answers 4xx or closes the
connection, in bounded time, and keeps serving."""

from __future__ import annotations

import asyncio
import gzip
import time

import aiohttp
import orjson
import pytest

from tests.router.chaos import TALLY, Tally, chat
from tests.router.conftest import running, settle

LIMITS = {
    "max_body_bytes": 64 * 1024,
    "header_timeout": 0.5,
    "body_timeout": 0.5,
    "max_header_bytes": 2048,
    "max_headers": 20,
}
CHAT_PATH = "/v1/chat/completions"


async def _connect(router) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", router.port)


def _head(extra: str = "", path: str = CHAT_PATH, method: str = "POST") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: kvroute\r\n{extra}".encode()


async def _status(reader: asyncio.StreamReader) -> int:
    line = await asyncio.wait_for(reader.readline(), 5)
    return int(line.split()[1])


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The first answer as sent (a 100 Continue too): status, headers (lower-case
    names), Content-Length body."""
    async with asyncio.timeout(5):
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        fields = (line.partition(":") for line in head[1:] if line)
        headers = {name.strip().lower(): value.strip() for name, _, value in fields}
        body = await reader.readexactly(int(headers.get("content-length", 0)))
    return int(head[0].split()[1]), headers, body


async def _closed_within(reader: asyncio.StreamReader, bound: float) -> float:
    """Seconds until the server closed the connection (read EOF), at most `bound`."""
    t0 = time.monotonic()
    async with asyncio.timeout(bound):
        while await reader.read(65536):
            pass
    return time.monotonic() - t0


async def _still_serving(router, tally: Tally) -> None:
    async with aiohttp.ClientSession() as http:
        await tally.send(http, router.url + CHAT_PATH, **chat())


async def test_slowloris_headers_are_cut_off() -> None:
    async with running(1, limits=LIMITS) as (router, _):
        tally = Tally.new()
        tally.add("sent")
        reader, writer = await _connect(router)
        writer.write(_head())

        async def trickle() -> None:
            for i in range(100):  # one header byte every 50 ms: never completes
                writer.write(b"X-Slow-%d: y\r\n"[:1] if i else b"X")
                await asyncio.sleep(0.05)

        dripping = asyncio.create_task(trickle())
        try:
            took = await _closed_within(reader, 3)
        finally:
            dripping.cancel()
            writer.close()
        assert 0.3 < took < 2.0  # closed by header_timeout, not by our giving up
        await _still_serving(router, tally)
        assert (tally.failed, tally.hung) == (0, 0)


async def test_slow_body_gets_408_and_the_connection_closes() -> None:
    async with running(1, limits=LIMITS) as (router, stubs):
        tally = Tally.new()
        tally.add("sent")
        reader, writer = await _connect(router)
        writer.write(_head("Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{"))
        t0 = time.monotonic()
        assert await _status(reader) == 408
        assert time.monotonic() - t0 < 2.0
        await _closed_within(reader, 3)
        writer.close()
        assert stubs[0].received == []
        await _still_serving(router, tally)
        assert (tally.failed, tally.hung) == (0, 0)


async def test_oversize_bodies_get_413_without_being_read_whole() -> None:
    async with running(1, limits=LIMITS) as (router, stubs):
        tally = Tally.new()
        # declared too large: refused on the headers alone
        tally.add("sent")
        reader, writer = await _connect(router)
        writer.write(_head("Content-Length: 1000000000\r\n\r\n") + b"{" * 1024)
        assert await _status(reader) == 413
        writer.close()
        # chunked, no length: refused once the limit is passed, while still sending
        tally.add("sent")
        reader, writer = await _connect(router)
        writer.write(_head("Transfer-Encoding: chunked\r\n\r\n"))
        sent = 0
        chunk = b"x" * 8192
        status = asyncio.create_task(_status(reader))
        try:
            while not status.done() and sent < 64 * 1024 * 1024:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
                await writer.drain()
        except ConnectionError:
            pass  # the router stopped reading and closed: fine
        assert await status == 413
        assert sent < 8 * 1024 * 1024  # answered long before the body could end
        writer.close()
        assert stubs[0].received == []
        await _still_serving(router, tally)
        assert (tally.failed, tally.hung) == (0, 0)


BIG_HEADER = "X-Big: " + "a" * 4096 + "\r\n"  # one header over max_header_bytes


@pytest.mark.parametrize(
    ("method", "path", "extra", "says"),
    [
        pytest.param("POST", CHAT_PATH, BIG_HEADER, "over 2048 bytes", id="long-header"),
        pytest.param(
            "POST",
            CHAT_PATH,
            "".join(f"X-H{i}: v\r\n" for i in range(40)),
            "more than 20 headers",
            id="too-many-headers",
        ),
        pytest.param(
            "POST", CHAT_PATH + "?" + "q" * 4096, "", "over 2048 bytes", id="long-request-line"
        ),
        pytest.param("GET", "/v1/models", BIG_HEADER, "over 2048 bytes", id="not-fast-path"),
    ],
)
async def test_header_floods_are_431_in_openai_json_without_an_echo(
    method: str, path: str, extra: str, says: str
) -> None:
    """The limit broken is named; the client's own bytes are never sent back to it."""
    async with running(1, limits=LIMITS) as (router, stubs):
        tally = Tally.new()
        tally.add("sent")
        reader, writer = await _connect(router)
        writer.write(_head(extra + "Content-Length: 2\r\n\r\n{}", path, method))
        status, headers, body = await _answer(reader)
        await _closed_within(reader, 3)
        writer.close()
        assert status == 431
        assert headers["content-type"] == "application/json" and headers["x-request-id"]
        error = orjson.loads(body)["error"]
        assert error["type"] == "RequestHeaderFieldsTooLargeError" and error["code"] == 431
        assert says in error["message"]
        assert b"aaaa" not in body and b"qqqq" not in body
        assert stubs[0].received == []
        await _still_serving(router, tally)
        assert (tally.failed, tally.hung) == (0, 0)


@pytest.mark.parametrize("path", [CHAT_PATH, "/v1/responses"], ids=["fast-path", "aiohttp"])
async def test_expect_continue_for_a_body_over_the_limit_is_413_instead(path: str) -> None:
    """A client waiting for `100 Continue` before a 17 MB upload hears the 413 first,
    and the connection closes: the body is never invited."""
    async with running(1, limits=LIMITS) as (router, stubs):
        reader, writer = await _connect(router)
        writer.write(_head("Expect: 100-continue\r\nContent-Length: 17000000\r\n\r\n", path))
        status, headers, body = await _answer(reader)
        await _closed_within(reader, 3)
        writer.close()
        assert (status, headers["connection"]) == (413, "close")
        assert headers["x-request-id"]
        assert "17000000 bytes exceeds the limit" in orjson.loads(body)["error"]["message"]
        assert stubs[0].received == []


async def test_expect_continue_for_a_body_within_the_limit_is_invited() -> None:
    async with running(1, limits=LIMITS) as (router, stubs):
        body = orjson.dumps(chat()["json"])
        reader, writer = await _connect(router)
        head = f"Expect: 100-continue\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(_head(head))
        assert (await _answer(reader))[0] == 100
        writer.write(body)
        assert (await _answer(reader))[0] == 200
        writer.close()
        assert stubs[0].raw == [body]


async def test_a_burst_beyond_the_queue_gets_503_with_retry_after_and_reason() -> None:
    limits = {"max_concurrent_requests": 2, "queue_size": 2, "queue_timeout": 5}
    async with running(1, limits=limits) as (router, stubs), aiohttp.ClientSession() as http:
        stubs[0].behaviour.delay = 0.3
        tally = Tally.new()
        url = router.url + CHAT_PATH
        replies = await asyncio.gather(
            *(tally.send(http, url, expect={200, 503}, **chat()) for _ in range(6))
        )
        assert sorted(r.status for r in replies) == [200] * 4 + [503] * 2  # 2 ran, 2 waited
        refused = [r for r in replies if r.status == 503]
        assert all(r.headers["Retry-After"] == "1" for r in refused)
        assert all(r.headers["x-kvroute-drop-reason"] == "queue_full" for r in refused)
        assert all(r.json()["error"]["type"] == "ServiceUnavailableError" for r in refused)
        stubs[0].behaviour.delay = 0.4
        short = {"max_concurrent_requests": 1, "queue_size": 5, "queue_timeout": 0.1}
        router.dispatcher.admission.configure(router.config.limits.__class__(**short))
        replies = await asyncio.gather(
            *(tally.send(http, url, expect={200, 503}, **chat()) for _ in range(3))
        )
        assert sorted(r.status for r in replies) == [200, 503, 503]  # waited, then gave up
        timed_out = next(r for r in replies if r.status == 503)
        assert "timed out" in timed_out.json()["error"]["message"]
        assert timed_out.headers["x-kvroute-drop-reason"] == "queue_timeout"
        await settle(router)
        assert router.dispatcher.admission.queued == 0
        assert (tally.failed, tally.hung) == (0, 0)
        assert TALLY.hung == 0


async def test_a_compressed_body_is_routed_and_forwarded_decoded() -> None:
    async with running(1) as (router, stubs), aiohttp.ClientSession() as http:
        tally = Tally.new()
        body = gzip.compress(orjson.dumps(chat()["json"]))
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        await tally.send(http, router.url + CHAT_PATH, data=body, headers=headers)
        assert stubs[0].received[-1]["model"] == chat()["json"]["model"]
        assert "Content-Encoding" not in stubs[0].headers[-1]  # the bytes went decoded
        reply = await tally.send(
            http, router.url + CHAT_PATH, expect=400, data=b"not gzip", headers=headers
        )
        assert "is not valid gzip" in reply.json()["error"]["message"]
        assert (tally.failed, tally.hung) == (0, 0)
