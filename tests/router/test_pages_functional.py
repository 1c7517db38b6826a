"""GETs beside the request path (router/upstream/pages.py) against scripted backends on
127.0.0.1: the page under the backend's prefix with its headers, one kept connection
for successive GETs, None for anything but a 200, and a GET given up on never leaving
its answer for the next one."""

from __future__ import annotations

import asyncio

from router.config import BackendConfig
from router.fleet.backend import Backend
from router.fleet.credentials import Reach
from router.upstream.pages import Pages
from tests.router.test_upstreams_functional import answering, backend, read_request

PAGE = b"vllm:num_requests_running 1.0\n"


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body


def of(url: object, prefix: str = "") -> Backend:
    b = Backend(BackendConfig(url=f"{url}{prefix}"))
    b.set_reach(Reach({"Authorization": "Bearer k"}, None))
    return b


async def test_a_page_comes_under_the_prefix_with_the_backends_headers_on_one_connection() -> None:
    heads: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            head, _ = await read_request(reader)
            heads.append(head)
            writer.write(ok(PAGE))
        await reader.read()

    async with backend(script) as (url, connections):
        pages = Pages(5.0)
        try:
            target = of(url, "/team/vllm")
            assert await pages.get(target, "/metrics") == PAGE
            assert await pages.get(target, "/metrics") == PAGE
        finally:
            pages.close()
    assert len(connections) == 1
    for head in heads:
        assert head.startswith(b"GET /team/vllm/metrics HTTP/1.1\r\n")
        assert b"\r\nAuthorization: Bearer k\r\n" in head
        assert f"\r\nHost: 127.0.0.1:{url.port}\r\n".encode() in head


async def test_anything_but_a_200_is_none_and_the_next_get_still_works() -> None:
    not_found = b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found"
    async with backend(answering(not_found, ok(PAGE))) as (url, _):
        pages = Pages(5.0)
        try:
            assert await pages.get(of(url), "/metrics") is None
            assert await pages.get(of(url), "/metrics") == PAGE
        finally:
            pages.close()


async def test_a_backend_that_breaks_off_or_listens_nowhere_is_none() -> None:
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nvllm:"
    async with backend(answering(cut, then_close=True)) as (url, _):
        pages = Pages(5.0)
        try:
            assert await pages.get(of(url), "/metrics") is None
        finally:
            pages.close()
    pages = Pages(5.0)
    try:
        assert await pages.get(of(url), "/metrics") is None  # its server is gone
    finally:
        pages.close()


async def test_a_get_given_up_on_leaves_no_answer_for_the_next() -> None:
    """The first GET's caller gives up between its answer's head and its body; that body,
    sent late, must not be taken for the second GET's answer."""
    asked = asyncio.Event()
    late = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not asked.is_set():  # the first connection: its answer's body comes late
            await read_request(reader)
            stale = ok(b"stale\n")
            writer.write(stale[:-6])
            await writer.drain()
            asked.set()
            await late.wait()
            writer.write(stale[-6:])
            await writer.drain()
        while True:  # any later request gets the fresh page
            await read_request(reader)
            writer.write(ok(PAGE))

    async with backend(script) as (url, connections):
        pages = Pages(5.0)
        try:
            target = of(url)
            first = asyncio.create_task(pages.get(target, "/metrics"))
            await asyncio.wait_for(asked.wait(), 5)
            first.cancel()
            late.set()
            assert await pages.get(target, "/metrics") == PAGE
        finally:
            pages.close()
    assert len(connections) == 2
