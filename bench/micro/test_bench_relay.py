"""Micro-benchmark of a stream's hot path: one SSE event relayed from backend to client.

Run: .venv/bin/pytest bench/micro/test_bench_relay.py --benchmark-enable
The baseline is what the relay did before it passed whole chunks on (and what aiohttp's
client does): aiohttp's C parser decodes the chunk into its StreamReader, the reader is
read, the event is framed again for the client. Both write to a transport that drops the
bytes, so the figures are the router's Python cost per event, without system calls.
"""

import asyncio
from collections.abc import Callable, Iterator

import pytest
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http import HttpResponseParser
from prometheus_client import CollectorRegistry, Histogram
from yarl import URL

from router.upstream.connection import _Connection
from router.upstream.proxy import Upstream, Upstreams

EVENT = (
    b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":0,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":" token"},"finish_reason":null}]}\n\n'
)
FRAMED = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class _NullTransport(asyncio.Transport):
    """Keeps only the last write (an assignment: both paths pay it alike)."""

    last = b""

    def write(self, data: bytes) -> None:
        self.last = data

    def writelines(self, data) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Sink:
    def __init__(self) -> None:
        self.out = _NullTransport()

    def put(self, chunk: bytes) -> None:
        self.out.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))

    def put_framed(self, chunks: bytes) -> None:
        self.out.write(chunks)

    def ready(self) -> bool:
        return True

    def on_ready(self, callback: Callable[[], None] | None) -> None:
        pass


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_baseline_aiohttp_parser_reader_and_framing(benchmark, loop) -> None:
    benchmark.group = "sse-relay-per-event"
    protocol = BaseProtocol(loop)
    protocol.transport = _NullTransport()
    parser = HttpResponseParser(protocol, loop, 2**16, read_until_eof=True)
    (_, payload), *_ = parser.feed_data(HEAD)[0]
    sink = _Sink()

    def one_event() -> None:
        parser.feed_data(FRAMED)
        sink.put(payload.read_nowait(-1))

    benchmark(one_event)
    assert sink.out.last == FRAMED  # the event went out, framed as the client reads it


def test_kvroute_relay(benchmark, loop) -> None:
    benchmark.group = "sse-relay-per-event"
    conn = _Connection(loop, Upstreams(), URL("http://127.0.0.1:1"))
    conn.transport = _NullTransport()
    answer = conn.send(b"POST / HTTP/1.1\r\n\r\n", b"", "POST")
    conn.data_received(HEAD)
    message, payload = answer.result()
    itl = Histogram("itl", "bench", registry=CollectorRegistry())

    async def relaying() -> None:
        async with asyncio.timeout(None) as deadline:
            upstream = Upstream(conn, message, payload, 600, loop.time() + 600, itl, _nop)
            upstream.watch(deadline)
            sink = _Sink()
            relay = asyncio.create_task(upstream.relay(sink))
            await asyncio.sleep(0)
            benchmark(conn.data_received, FRAMED)
            assert not relay.done()  # every event was relayed: none ended or broke it
            assert sink.out.last == FRAMED  # the same bytes as the baseline wrote
            relay.cancel()

    loop.run_until_complete(relaying())


def _nop() -> None:
    pass
