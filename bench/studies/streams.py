"""Many concurrent SSE clients on bare asyncio protocols, cheap enough to hold 10,000.

Each `Stream` is one connection carrying one streaming request. It reads the status
line, then counts events as they arrive by their `data: ` prefix (a match split across
two reads is found through a 5-byte tail, shorter than the prefix, so nothing is counted
twice) and closes once `data: [DONE]` arrived. Nothing is parsed or kept, so the client
costs a few microseconds per read and the router is what a benchmark measures. A shared
`Board` totals events and tracks how many streams are open (the peak proves they were
open at once).

    board = Board()
    streams = await open_streams("http://127.0.0.1:8000", 1000, body, board)
    await board.wait_closed(60)

Not a study of its own: the SSE client of docs/performance.md, "Throughput beside the
Rust routers" and "New requests while streams flow" (bench.studies.throughput and
fairness), and of tests/e2e/test_many_streams_functional.py.
"""

from __future__ import annotations

import asyncio
import time

from yarl import URL

_PREFIX = b"data: "
_DONE = b"[DONE]"
_TAIL = len(_PREFIX) - 1


class Board:
    """Totals over every stream of one run."""

    def __init__(self) -> None:
        self.events = 0  # `data: ` lines seen, [DONE] included
        self.open = 0  # connected and not closed
        self.peak = 0
        self.done = 0
        self.errors: list[str] = []
        self._idle = asyncio.Event()
        self._idle.set()

    def opened(self) -> None:
        self.open += 1
        self.peak = max(self.peak, self.open)
        self._idle.clear()

    def closed(self) -> None:
        self.open -= 1
        if self.open == 0:
            self._idle.set()

    async def wait_closed(self, timeout: float) -> None:
        await asyncio.wait_for(self._idle.wait(), timeout)


class Stream(asyncio.Protocol):
    """One streaming request on its own connection."""

    def __init__(self, request: bytes, board: Board) -> None:
        self._request = request
        self._board = board
        self._tail = b""
        self.status = 0
        self.events = 0
        self.done = False
        self._ended = False  # closed by us, or failed: a later close is no error
        self.transport: asyncio.Transport | None = None
        self.first = asyncio.get_running_loop().create_future()  # first bytes, or failure

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._board.opened()
        transport.write(self._request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if not self.status:
            data = self._tail + data
            if len(data) < 12:  # `HTTP/1.1 200` not whole yet
                self._tail = data
                return
            self._tail = b""
            self.status = int(data[9:12])
            if self.status != 200:
                self.fail(f"status {self.status}: {data[:200]!r}")
                return
            if self.first.done():  # given up on (timed out) before the answer came
                return
            self.first.set_result(None)
        window = self._tail + data
        seen = window.count(_PREFIX)
        self.events += seen
        self._board.events += seen
        self._tail = window[-_TAIL:]
        if _DONE in window:
            self.done = True
            self._board.done += 1
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._board.closed()
        if not (self.done or self._ended):
            self.fail(f"closed after {self.events} events ({exc or 'by the server'})")

    def close(self) -> None:
        """End the stream from the client side (not an error)."""
        self._ended = True
        if self.transport is not None:
            self.transport.close()

    def fail(self, why: str) -> None:
        self._ended = True
        self._board.errors.append(why)
        if not self.first.done():
            self.first.set_exception(ConnectionError(why))
            self.first.exception()  # retrieved: nobody may be awaiting it any more
        if self.transport is not None:
            self.transport.close()


def request_bytes(url: str, path: str, body: bytes) -> bytes:
    host = URL(url).raw_authority
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def open_streams(
    url: str,
    n: int,
    body: bytes,
    board: Board,
    *,
    path: str = "/v1/chat/completions",
    pending: int = 100,
    timeout: float = 60.0,
) -> list[Stream]:
    """Open `n` streams, at most `pending` of them awaiting their first bytes at a time,
    below a server's listen backlog (aiohttp's default is 128: an overrun drops the SYN,
    retried after 1, 3, 7, 15... s); return once each has answered or failed. A failure
    is in `board.errors`, never raised: the caller closes them all."""
    loop = asyncio.get_running_loop()
    target = URL(url)
    request = request_bytes(url, path, body)
    gate = asyncio.Semaphore(pending)
    deadline = time.monotonic() + timeout

    async def one() -> Stream:
        async with gate:
            stream = Stream(request, board)
            try:
                await loop.create_connection(lambda: stream, target.host, target.port)
                await asyncio.wait_for(stream.first, max(0.1, deadline - time.monotonic()))
            except ConnectionError:
                pass  # on the board already
            except (OSError, TimeoutError) as exc:
                stream.fail(f"no answer: {exc!r}")
            return stream

    return list(await asyncio.gather(*(one() for _ in range(n))))
