"""The request path's HTTP/1.1 client (router.proxy.Upstreams) against scripted backends:
keep-alive reuse, every way an answer can be framed, cut bodies, stale connections,
flow control and idle expiry."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, Histogram
from yarl import URL

from router.errors import UpstreamConnectError, UpstreamDisconnected, UpstreamError
from router.upstream import pool as proxy
from router.upstream.proxy import Upstream, Upstreams, open_upstream

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (bodies here always have a Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


def answering(*answers: bytes, then_close: bool = False) -> Script:
    """A backend that answers each request on a connection with the next of `answers`."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            await read_request(reader)
            writer.write(answer)
            await writer.drain()
        if then_close:
            writer.close()
        else:
            await reader.read()  # until the router closes

    return script


@asynccontextmanager
async def backend(script: Script) -> AsyncIterator[tuple[URL, list[asyncio.StreamWriter]]]:
    """A scripted backend on 127.0.0.1; yields its URL and its connections so far."""
    connections: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        try:
            await script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield URL(f"http://127.0.0.1:{port}"), connections
    finally:
        server.close()
        for writer in connections:
            writer.close()


async def send(
    upstreams: Upstreams, url: URL, method: str = "POST", body: bytes = b"{}"
) -> Upstream:
    end = asyncio.get_running_loop().time() + 10
    headers = CIMultiDict({"X-Test": "1"})
    return await open_upstream(
        upstreams, url, "/v1/x?a=1", method, body, headers, 1.0, 5.0, end, _ITL, _nop
    )


_ITL = Histogram("itl", "test", registry=CollectorRegistry())


def _nop() -> None:
    pass


async def body_of(upstream: Upstream) -> bytes:
    data = await upstream.read()
    upstream.finish(True)
    return data


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def test_keep_alive_reuses_one_connection_and_sends_the_request_as_given() -> None:
    seen: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(3):
            head, body = await read_request(reader)
            seen.append(head + body)
            writer.write(ok(b"answer"))
        await reader.read()

    upstreams = Upstreams()
    async with backend(script) as (url, connections):
        for _ in range(3):
            assert await body_of(await send(upstreams, url)) == b"answer"
        assert len(connections) == 1
        assert seen[0] == (
            b"POST /v1/x?a=1 HTTP/1.1\r\nHost: %s\r\nX-Test: 1\r\nContent-Length: 2\r\n\r\n{}"
            % url.host_port_subcomponent.encode()
        )
    upstreams.close()


@pytest.mark.parametrize(
    ("answer", "method", "body"),
    [
        pytest.param(ok(b"fixed"), "POST", b"fixed", id="content-length"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\nTrailer: x\r\n\r\n",
            "POST",
            b"abcde",
            id="chunked",
        ),
        pytest.param(b"HTTP/1.1 200 OK\r\n\r\nuntil close", "POST", b"until close", id="eof"),
        pytest.param(b"HTTP/1.1 204 No Content\r\n\r\n", "DELETE", b"", id="no-content"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", "HEAD", b"", id="head"),
        pytest.param(
            b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"final"), "POST", b"final", id="interim"
        ),
    ],
)
async def test_every_framing_of_an_answer(answer: bytes, method: str, body: bytes) -> None:
    upstreams = Upstreams()
    then_close = body == b"until close"
    async with backend(answering(answer, then_close=then_close)) as (url, _):
        upstream = await send(upstreams, url, method, b"" if method != "POST" else b"{}")
        assert upstream.status != 100
        assert await body_of(upstream) == body
    upstreams.close()


async def test_stream_chunks_arrive_as_the_backend_flushes_them() -> None:
    go = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n6\r\ndata 1\r\n"
        )
        await go.wait()
        writer.write(b"6\r\ndata 2\r\n0\r\n\r\n")
        await reader.read()

    upstreams = Upstreams()
    async with backend(script) as (url, _):
        upstream = await send(upstreams, url)
        assert upstream.streaming
        async with asyncio.timeout(5) as deadline:
            upstream.watch(deadline)
            chunks = upstream.chunks()
            assert await anext(chunks) == b"data 1"
            go.set()
            assert [chunk async for chunk in chunks] == [b"data 2"]
        upstream.finish(True)
    upstreams.close()


async def test_a_cut_body_is_a_disconnect_and_the_connection_is_dropped() -> None:
    upstreams = Upstreams()
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"
    async with backend(answering(cut, then_close=True)) as (url, _):
        upstream = await send(upstreams, url)
        with pytest.raises(UpstreamDisconnected, match="The backend broke off the answer"):
            await upstream.read()
        upstream.finish(True)
    assert not upstreams._idle
    upstreams.close()


async def test_a_connection_the_backend_closed_while_idle_is_not_reused() -> None:
    upstreams = Upstreams()
    async with backend(answering(ok(b"once"), then_close=True)) as (url, connections):
        assert await body_of(await send(upstreams, url)) == b"once"
        await asyncio.sleep(0.1)  # the backend's FIN arrives
        assert await body_of(await send(upstreams, url)) == b"once"
        assert len(connections) == 2
    upstreams.close()


async def test_an_idempotent_request_is_sent_again_on_a_connection_closed_in_flight() -> None:
    served = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        served += 1
        await read_request(reader)
        if served == 1:
            writer.write(ok(b"first"))
            await read_request(reader)  # the next request on this connection: drop it
            return
        writer.write(ok(b"again"))
        await reader.read()

    upstreams = Upstreams()
    async with backend(script) as (url, connections):
        assert await body_of(await send(upstreams, url, "GET", b"")) == b"first"
        assert await body_of(await send(upstreams, url, "GET", b"")) == b"again"
        assert len(connections) == 2
    upstreams.close()


async def test_failures_before_an_answer() -> None:
    upstreams = Upstreams()
    async with backend(answering(b"not http at all\r\n\r\n")) as (url, _):
        with pytest.raises(UpstreamError, match="The backend answered with malformed HTTP"):
            await send(upstreams, url)
    with pytest.raises(UpstreamConnectError, match="The backend refused the connection"):
        await send(upstreams, url)  # the backend is gone: refused
    upstreams.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_slow_reader_pauses_the_backend_and_loses_nothing(chunked: bool) -> None:
    size = 32 << 20  # past what loopback sockets' kernel buffers hold (they autotune to MBs)
    paused = asyncio.Event()
    block = b"x" * (1 << 16)

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if chunked:  # decoded by the router's own ChunkedBody, not aiohttp's parser
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.writelines([b"%x\r\n%s\r\n" % (len(block), block)] * (size >> 16))
            writer.write(b"0\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            writer.writelines([block] * (size >> 16))
        while writer.transport.get_write_buffer_size() < size // 2:
            await asyncio.sleep(0.01)  # the router stopped reading: our buffer fills
        paused.set()
        await writer.drain()
        await reader.read()

    upstreams = Upstreams()
    async with backend(script) as (url, _):
        upstream = await send(upstreams, url)
        await asyncio.wait_for(paused.wait(), 5)
        assert len(await body_of(upstream)) == size
    upstreams.close()


async def test_an_unfinished_exchange_closes_its_connection() -> None:
    gone = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n")
        await reader.read()
        gone.set()

    upstreams = Upstreams()
    async with backend(script) as (url, _):
        upstream = await send(upstreams, url)
        upstream.finish(False)  # e.g. the client left mid-stream
        await asyncio.wait_for(gone.wait(), 5)
    upstreams.close()


def answers_once(gone: asyncio.Event):
    """A backend script: one answer, then `gone` is set once the router's side closes."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answering(ok(b"x"))(reader, writer)
        gone.set()

    return script


async def test_idle_connections_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy, "KEEPALIVE_SECONDS", 0.05)
    gone = asyncio.Event()
    script = answers_once(gone)
    upstreams = Upstreams()
    async with backend(script) as (url, _):
        await body_of(await send(upstreams, url))
        await asyncio.wait_for(gone.wait(), 5)
        assert not upstreams._idle
    upstreams.close()


async def test_close_closes_the_idle_connections() -> None:
    gone = asyncio.Event()
    script = answers_once(gone)
    upstreams = Upstreams()
    async with backend(script) as (url, _):
        await body_of(await send(upstreams, url))
        upstreams.close()
        await asyncio.wait_for(gone.wait(), 5)


class RecordingSink:
    """A relay's sink that records how each write came: re-framed (`put`) or as the
    backend framed it (`put_framed`); `ready` can be switched off like a full socket."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, bytes]] = []
        self.is_ready = True
        self.arrived = asyncio.Event()
        self._on_ready: Callable[[], None] | None = None

    def put(self, chunk: bytes) -> None:
        self._record("put", b"%x\r\n%b\r\n" % (len(chunk), chunk))

    def put_framed(self, chunks: bytes) -> None:
        self._record("framed", chunks)

    def _record(self, how: str, data: bytes) -> None:
        self.writes.append((how, data))
        self.arrived.set()

    def ready(self) -> bool:
        return self.is_ready

    def on_ready(self, callback: Callable[[], None] | None) -> None:
        self._on_ready = callback

    def resume(self) -> None:
        self.is_ready = True
        if self._on_ready is not None:
            self._on_ready()

    async def next_write(self) -> None:
        await asyncio.wait_for(self.arrived.wait(), 5)
        self.arrived.clear()

    def body(self) -> bytes:
        return _dechunk(b"".join(data for _, data in self.writes))


def _dechunk(framed: bytes) -> bytes:
    out, pos = [], 0
    while pos < len(framed):
        eol = framed.index(b"\r\n", pos)
        size = int(framed[pos:eol], 16)
        out.append(framed[eol + 2 : eol + 2 + size])
        assert framed[eol + 2 + size : eol + 4 + size] == b"\r\n"
        pos = eol + 4 + size
    return b"".join(out)


@asynccontextmanager
async def watched(script: Script) -> AsyncIterator[tuple[Upstreams, Upstream]]:
    """One request to a scripted backend, its answer's body guarded by a 5 s timeout."""
    upstreams = Upstreams()
    async with backend(script) as (url, _):
        upstream = await send(upstreams, url)
        async with asyncio.timeout(5) as deadline:
            upstream.watch(deadline)
            yield upstreams, upstream
    upstreams.close()


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


async def test_a_relay_passes_whole_chunks_on_as_they_came_and_reframes_split_ones() -> None:
    sink = RecordingSink()
    step = asyncio.Queue()
    usage = b'data: {"usage":{"prompt_tokens_details":{"cached_tokens":48}}}\n\n'
    writes = [
        b"b\r\ndata: one\n\n\r\n",
        b"B\r\ndata: two\n\n\r\n",  # an unusual size line: decoded, framed again
        b"d\r\ndata: th",  # a chunk split over two reads
        b"ree\n\n\r\n",
        b"%x\r\n%s\r\n" % (len(usage), usage),
        b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n",  # apart from the usage event
    ]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await read_request(reader)
            writer.write(SSE_HEAD)
            for data in writes:
                await step.get()
                writer.write(data)
        await reader.read()

    upstreams = Upstreams()
    async with backend(script) as (url, connections):
        for _ in range(2):  # the connection is reused: the decoder ended at the body's end
            sink.writes.clear()
            sink.arrived.clear()
            upstream = await send(upstreams, url)
            async with asyncio.timeout(5) as deadline:
                upstream.watch(deadline)
                relay = asyncio.create_task(upstream.relay(sink))
                for data in writes[:-1]:
                    step.put_nowait(None)
                    if data != b"d\r\ndata: th":
                        await sink.next_write()
                step.put_nowait(None)
                await relay
            upstream.finish(True)
            assert sink.body() == b"data: one\n\ndata: two\n\ndata: three\n\n" + usage + (
                b"data: [DONE]\n\n"
            )
            framed = [data for how, data in sink.writes if how == "framed"]
            assert framed[:1] == [writes[0]] and writes[4] in framed
            assert upstream.usage().cached == 48
        assert len(connections) == 1
    upstreams.close()


async def test_a_relay_whose_sink_is_full_keeps_order_and_loses_nothing() -> None:
    sink = RecordingSink()
    sink.is_ready = False
    events = [b"data: %d\n\n" % i for i in range(50)]
    sent = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.001)
        sent.set()
        await asyncio.sleep(0.2)
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(events[0]), events[0]))
        await reader.read()

    async with watched(script) as (_, upstream):
        relay = asyncio.create_task(upstream.relay(sink))
        await sent.wait()
        assert not sink.writes  # nothing written while the sink is full
        sink.resume()
        assert sink.body() == b"".join(events)  # what waited, in order
        await relay
        assert sink.body() == b"".join(events) + events[0]
        assert sink.writes[-1][0] == "framed"  # once drained, reads pass on again
        upstream.finish(True)


async def test_invalid_chunked_framing_breaks_the_relay_and_drops_the_connection() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + b"b\r\ndata: one\n\n\r\nzz\r\n")
        await reader.read()

    async with watched(script) as (upstreams, upstream):
        with pytest.raises(UpstreamDisconnected, match="The backend sent a malformed stream"):
            await upstream.relay(RecordingSink())
        upstream.finish(True)
        assert not upstreams._idle


class _Attempt:
    """Like router/dispatch/attempt.py's: it holds its upstream, whose clock calls back
    into it when the first chunk comes."""

    def __init__(self) -> None:
        self.upstream: Upstream | None = None
        self.firsts = 0

    def prefilled(self) -> None:
        self.firsts += 1


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
async def test_an_ended_exchange_goes_without_a_collector_pass(chunked: bool) -> None:
    """Once the exchange ended nothing ties the attempt to its upstream: its objects go
    as its last reference does, not in a garbage-collector pass that would free those of
    hundreds of requests at once on the event loop."""
    answer = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
        if chunked
        else ok(b"abc")
    )
    upstreams = Upstreams()
    gc.disable()
    try:
        async with backend(answering(answer)) as (url, _):
            attempt = _Attempt()
            end = asyncio.get_running_loop().time() + 10
            attempt.upstream = await open_upstream(
                upstreams,
                url,
                "/v1/x",
                "POST",
                b"{}",
                CIMultiDict(),
                1.0,
                5.0,
                end,
                _ITL,
                attempt.prefilled,
            )
            assert await body_of(attempt.upstream) == b"abc"
            gone = weakref.ref(attempt)
            del attempt
            assert gone() is None
    finally:
        gc.enable()
        upstreams.close()
