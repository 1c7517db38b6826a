"""The fast path for the generation endpoints: an asyncio protocol in front of aiohttp.

Why: aiohttp's web server was ~35% of the router's CPU per request (request object,
router resolution, middlewares, response object, per-connection task wake-ups), most of
the added latency. Each connection starts here. A request's bytes go through aiohttp's
own C parser (llhttp, with the configured header limits); a common request - POST to
/v1/chat/completions, /v1/completions or /v1/embeddings, HTTP/1.1, whose head came in
one read, with a Content-Length body within `max_body_bytes`, no Content-Encoding,
Expect or Upgrade - is answered here, through the same `HttpIngress.serve` as aiohttp's
handlers. Anything else (another path, a head split over reads, chunked or gzip bodies,
a malformed request or one over the header limits, a body declared over the limit,
requests pipelined in one read) hands the connection, with every byte of that request,
to aiohttp's RequestHandler (http_ingress.IngressHandler) for the rest of its life: its
limits (431), slowloris timeouts, `Expect: 100-continue` (a 413 instead for a body
declared over the limit), lingering close and OpenAI-style errors apply as before.

`serve` starts once the head is in. A body still coming then is not read until `serve`
asks for it (`_BodyReceiver`), after the token check and with its size reserved in the
body budget: a refused request (401, 503) has nothing of its body buffered, its answer
says `Connection: close`, and what still comes of the body is dropped for a moment
before the close, as aiohttp's lingering close does. Once asked for, the body must
arrive within `body_timeout` (else 408). Bytes after it (a pipelined request) wait for
the answer. A client that half-closes after its request still gets its answer.

Answers are written with one `transport.write` per message (head and body together;
one per SSE chunk, chunked-encoded). A stream is relayed from the backend connection's
own callback straight into the client's transport (`Upstream.relay`; FastReply is the
sink): no task wake-up per event, and a client that reads slowly pauses the backend's
socket through the body reader's limit. A client that goes away cancels its request, as
aiohttp's `handler_cancellation` does. A connection idle for `keepalive` seconds is
closed (one timer per idle period, re-armed lazily).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus

from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http import HttpRequestParser, HttpVersion11, RawRequestMessage
from aiohttp.http_exceptions import HttpProcessingError

from router import log
from router.errors import INTERNAL, KvrouteError
from router.ingress.body_budget import BodyBudget
from router.ingress.web import (
    LINGER_SECONDS,
    REQUEST_ID,
    HttpIngress,
    request_id,
    watch_half_closed,
)
from router.request import Kind
from router.upstream.proxy import Sink, header_lines

ROUTES = {
    "/v1/chat/completions": Kind.CHAT,
    "/v1/completions": Kind.COMPLETION,
    "/v1/embeddings": Kind.EMBEDDING,
}
_REASONS = {s.value: s.phrase for s in HTTPStatus}
_LAST_CHUNK = b"0\r\n\r\n"
_INTERNAL = KvrouteError(INTERNAL)


class FastConnections:
    """The fast path's listener side: makes connections, tracks them, drains them."""

    def __init__(
        self,
        ingress: HttpIngress,
        fallback: Callable[[], asyncio.Protocol],
        max_body: int,
        body_timeout: float,
        keepalive: float,
        parser_limits: Mapping[str, int],
    ) -> None:
        self.ingress = ingress
        self.fallback = fallback
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.keepalive = keepalive
        self.linger = min(LINGER_SECONDS, body_timeout)  # as aiohttp's lingering_time
        self.parser_limits = dict(parser_limits)
        self.open: set[FastConnection] = set()
        self.closing = False

    def __call__(self) -> FastConnection:
        return FastConnection(self)

    async def drain(self, timeout: float) -> None:
        """Close idle connections now; let requests in flight finish within `timeout`,
        then cut what is left. Their answers say `Connection: close`. The dispatcher's
        drain deadline comes first (router/control/worker.py): by this one, what is left is an
        answer ended with a "shutting down" error that its client does not read."""
        self.closing = True
        busy = []
        for conn in list(self.open):
            if conn.task is None:
                conn.close()
            else:
                busy.append(conn.task)
        if busy:
            _, late = await asyncio.wait(busy, timeout=timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for conn in list(self.open):
            conn.close()


class FastConnection(BaseProtocol):
    """One client connection while the fast path holds it: one request at a time."""

    __slots__ = (
        "_closing",
        "_idle_at",
        "_idle_timer",
        "_owner",
        "_pending",
        "_receiving",
        "_reply",
        "on_resume",
        "task",
    )

    def __init__(self, owner: FastConnections) -> None:
        super().__init__(asyncio.get_running_loop())
        self._owner = owner
        self.task: asyncio.Task | None = None
        self._pending = b""  # bytes that came while a request was being answered
        self._receiving: _BodyReceiver | None = None  # a body still coming, or lingering
        self._reply: FastReply | None = None  # the answer of the request being served
        self._closing = False  # close once the current answer is out
        self._idle_at = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        #: a relayed stream waiting for the client's buffer to drain (FastReply.on_ready)
        self.on_resume: Callable[[], None] | None = None

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.on_resume is not None:
            self.on_resume()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._owner.open.add(self)
        self._idle()

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self._owner.open.discard(self)
        self._stop_receiving()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self.task is not None:
            self.task.cancel()  # the client left: stop its request

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool:
        """The client shut its sending side, as HTTP allows once its request is out:
        answer that request, then close (True keeps the transport open to write it),
        while `watch_half_closed` notices a client that in fact went away. With no
        whole request in, there is nothing to answer: close now. Once the answer has
        begun, a FIN is the client leaving, as before: nothing tells the two apart
        without writing, and a stream may pause for seconds (queued, a long prefill)
        while a client that left must not hold the backend."""
        self._closing = True
        if self.task is None or self._receiving is not None or not self._unanswered():
            return False
        watch_half_closed(self.transport, self._unanswered)
        return True

    def _unanswered(self) -> bool:
        reply = self._reply
        return reply is not None and not reply.started

    def data_received(self, data: bytes) -> None:
        if not data:
            return
        if self._receiving is not None:  # the body, and anything sent after it
            data = self._receiving.feed(data)
            if not data:
                return
        if self.task is not None:  # the client did not wait for the answer
            self._pending += data
            if len(self._pending) > self._owner.max_body:
                self._pause_reading_for_buffer()  # until this answer is out
            return
        self._process(data)

    def _process(self, data: bytes) -> None:
        """Serve `data` if it starts one common request, else hand it to aiohttp."""
        owner = self._owner
        parser = HttpRequestParser(
            self, self._loop, owner.max_body + 1, auto_decompress=False, **owner.parser_limits
        )
        try:
            messages, upgraded, tail = parser.feed_data(data)
        except HttpProcessingError:
            messages = ()
        if len(messages) != 1 or upgraded or tail:
            self._hand_over(data)
            return
        message, payload = messages[0]
        kind = ROUTES.get(message.path) if message.method == "POST" else None
        if kind is None or not _plain(message, owner.max_body) or owner.closing:
            self._hand_over(data)
            return
        # the request's bytes; more in this read would be a pipelined request, which the
        # parser keeps to itself: aiohttp serves those
        length = int(message.headers.get("Content-Length", 0))
        if len(data) > data.find(b"\r\n\r\n") + 4 + length:
            self._hand_over(data)
            return
        arrived = payload.read_nowait(-1)
        if payload.is_eof():
            body: Callable[[], Awaitable[bytes]] = _Body(arrived, owner.ingress.bodies)
        else:  # still coming (e.g. a client that writes head and body apart): read on demand
            body = self._receiving = _BodyReceiver(self, arrived, length)
            self._pause_reading_for_buffer()
        self._closing = message.should_close
        self.task = self._loop.create_task(self._serve(kind, message, body))

    def _stop_receiving(self) -> None:
        if self._receiving is not None:
            self._receiving.stop()
        self._receiving = None

    async def _serve(
        self, kind: Kind, message: RawRequestMessage, read_body: Callable[[], Awaitable[bytes]]
    ) -> None:
        reply = self._reply = FastReply(self)
        try:
            await self._owner.ingress.serve(
                kind, message.method, message.path, message.headers, read_body, reply
            )
        except (ConnectionError, asyncio.CancelledError):
            self._closing = True
        except Exception:  # a bug of ours: aiohttp would answer 500 and log it too
            self._closing = True
            log.http.exception("error handling %s %s", message.method, message.path)
            if not reply.started:
                extra = {REQUEST_ID: request_id(message.headers)}
                with contextlib.suppress(ConnectionError):
                    await reply.whole(500, *_INTERNAL.http_answer(extra))
        finally:
            self.task = self._reply = None
            self._after_answer()

    def _after_answer(self) -> None:
        if self._receiving is not None:  # refused, or late: its body was not read whole
            self._receiving.linger()
            return
        if self._closing or self._owner.closing or self.transport is None:
            self.close()
            return
        self._idle()
        if self._buffer_paused:
            self._resume_reading_for_buffer()
        if self._pending:
            data, self._pending = self._pending, b""
            self._process(data)

    def _hand_over(self, data: bytes) -> None:
        """aiohttp's server takes the connection, starting from `data`, for good."""
        transport = self.transport
        if transport is None:
            return
        self._owner.open.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        handler = self._owner.fallback()
        transport.set_protocol(handler)
        self.transport = None
        handler.connection_made(transport)
        handler.data_received(data)
        if self._paused:  # the socket's buffer was full: tell the new owner
            handler.pause_writing()

    def _idle(self) -> None:
        """Close after `keepalive` seconds without a request (one timer per idle period)."""
        self._idle_at = time.monotonic()
        if self._idle_timer is None:
            self._idle_timer = self._loop.call_later(self._owner.keepalive, self._idle_check)

    def _idle_check(self) -> None:
        self._idle_timer = None
        if self.task is not None or self._receiving is not None:
            return  # busy: the end of its answer starts the next idle period
        left = self._idle_at + self._owner.keepalive - time.monotonic()
        if left > 0:
            self._idle_timer = self._loop.call_later(left, self._idle_check)
        else:
            self.close()


class _Body:
    """A body that came whole with its head, as `HttpIngress.serve` reads it: its
    bytes reserved in the body budget."""

    __slots__ = ("_bodies", "_body")

    def __init__(self, body: bytes, bodies: BodyBudget) -> None:
        self._body = body
        self._bodies = bodies

    async def __call__(self) -> bytes:
        self._bodies.take(len(self._body))
        return self._body


class _BodyReceiver:
    """A Content-Length body still coming when its head was served. The connection
    reads none of it until `HttpIngress.serve` asks for it, which it does after the
    token check and once its size is reserved in the body budget: so a refused request
    (401, 503) costs no more than the one read its head came in. Once asked, the body
    must be whole within `body_timeout` (else 408).

    After an answer that left it unread, `linger` drops what still comes of it, then
    closes: the client reads its answer instead of a reset."""

    __slots__ = ("_body", "_chunks", "_conn", "_got", "_size", "_timer")

    def __init__(self, conn: FastConnection, arrived: bytes, size: int) -> None:
        self._conn = conn
        self._size = size
        self._got = len(arrived)
        self._chunks: list[bytes] | None = [arrived]  # None: dropping them (lingering)
        self._body: asyncio.Future[bytes] = conn._loop.create_future()
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(self) -> bytes:
        conn, owner = self._conn, self._conn._owner
        owner.ingress.bodies.take(self._size)
        self._timer = conn._loop.call_later(owner.body_timeout, self._late)
        conn._resume_reading_for_buffer()
        try:
            return await self._body
        except BaseException:
            owner.ingress.bodies.give(self._size)
            raise

    def feed(self, data: bytes) -> bytes:
        """Take the body's part of `data`; return what came after it."""
        need = self._size - self._got
        if len(data) > need:
            data, rest = data[:need], data[need:]
        else:
            rest = b""
        self._got += len(data)
        whole = self._got == self._size
        if self._chunks is None:  # lingering
            if whole:
                self._conn.close()
            return b""
        self._chunks.append(data)
        if whole:
            self._body.set_result(b"".join(self._chunks))
            self._conn._stop_receiving()
        return rest

    def linger(self) -> None:
        conn = self._conn
        self.stop()
        self._chunks = None
        self._timer = conn._loop.call_later(conn._owner.linger, conn.close)
        conn._resume_reading_for_buffer()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self._body.done():
            self._body.cancel()

    def _late(self) -> None:
        self._body.set_exception(self._conn._owner.ingress.body_late())


def _plain(message: RawRequestMessage, max_body: int) -> bool:
    """HTTP/1.1 with a plain Content-Length body within the limit: nothing aiohttp must
    decode, refuse or answer first."""
    headers = message.headers
    length = headers.get("Content-Length", "0")
    return (
        message.version == HttpVersion11
        and not message.chunked
        and not message.upgrade
        and "Content-Encoding" not in headers
        and "Expect" not in headers
        and length.isdigit()
        and int(length) <= max_body
    )


class FastReply:
    """A Reply written straight to the connection's transport; streamed bodies are
    relayed into it by the backend connection itself (it is their Sink)."""

    __slots__ = ("_conn", "started")

    def __init__(self, conn: FastConnection) -> None:
        self._conn = conn
        self.started = False

    @property
    def sink(self) -> Sink:
        return self

    def _head(self, status: int, headers: Mapping[str, str], framing: str) -> bytes:
        conn = self._conn
        # a body left unread (a refusal before it) is not worth the connection
        close = conn._closing or conn._owner.closing or conn._receiving is not None
        connection = "Connection: close\r\n" if close else ""
        reason = _REASONS.get(status, "")
        return (
            f"HTTP/1.1 {status} {reason}\r\n{header_lines(headers)}{framing}{connection}\r\n"
        ).encode("latin-1", "surrogateescape")

    async def whole(
        self, status: int, headers: Mapping[str, str], body: bytes, close: bool = False
    ) -> None:
        conn = self._conn
        if close:
            conn._closing = True
        self.started = True
        await self._write(self._head(status, headers, f"Content-Length: {len(body)}\r\n") + body)

    async def begin(self, status: int, headers: Mapping[str, str]) -> None:
        self.started = True
        await self._write(self._head(status, headers, "Transfer-Encoding: chunked\r\n"))

    def send(self, chunk: bytes) -> Awaitable[None] | None:
        """One chunk, one write; the caller awaits only when the socket's buffer is full."""
        self.put(chunk)
        return None if self.ready() else self._conn._drain_helper()

    async def end(self) -> None:
        await self._write(_LAST_CHUNK)

    # the Sink Upstream.relay writes to, from the backend connection's callbacks
    def put(self, chunk: bytes) -> None:
        if chunk:
            self._raw(b"%x\r\n%b\r\n" % (len(chunk), chunk))

    def put_framed(self, chunks: bytes) -> None:
        self._raw(chunks)

    def ready(self) -> bool:
        return not self._conn.writing_paused

    def on_ready(self, callback: Callable[[], None] | None) -> None:
        self._conn.on_resume = callback

    async def _write(self, data: bytes) -> None:
        self._raw(data)
        if not self.ready():
            await self._conn._drain_helper()

    def _raw(self, data: bytes) -> None:
        transport = self._conn.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        transport.write(data)


class FastSite(web.TCPSite):
    """aiohttp's TCP site, listening with the fast path in front of aiohttp's server."""

    def __init__(self, runner: web.AppRunner, fast: FastConnections, **kwargs) -> None:
        super().__init__(runner, **kwargs)
        self._fast = fast

    async def start(self) -> None:
        self._runner._reg_site(self)
        self._server = await asyncio.get_running_loop().create_server(
            self._fast,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )

    async def stop(self) -> None:
        """Stop listening, then drain the fast path; aiohttp drains its own connections."""
        await super().stop()
        await self._fast.drain(self._runner._shutdown_timeout)
