"""The fast path for the generation endpoints: an asyncio protocol in front of aiohttp.

Why: aiohttp's web server was ~35% of the router's CPU per request (request object,
router resolution, middlewares, response object, per-connection task wake-ups), most of
the added latency. Each connection starts here. A request's first read is parsed by
httptools (router/ingress/fast_request.py); a common request - POST to
/v1/chat/completions, /v1/completions or /v1/embeddings, HTTP/1.1, whose head came in
one read, with a Content-Length body within `max_body_bytes`, no Content-Encoding,
Expect or Upgrade - is answered here, through the same `HttpIngress.serve` as aiohttp's
handlers. Anything else (another path, a head split over reads, chunked or gzip bodies,
a malformed request or one near or over the header limits, a body declared over the
limit, requests pipelined in one read) hands the connection, with every byte of that
request, to aiohttp's RequestHandler (ingress/web.py IngressHandler) for the rest of its
life: its limits (431), slowloris timeouts, `Expect: 100-continue` (a 413 instead for a
body declared over the limit), lingering close and OpenAI-style errors apply as before.

`serve` starts once the head is in; a body still coming then is read only when `serve`
asks for it (router/ingress/fast_body.py), and a refused request's answer says
`Connection: close`. Bytes after it (a pipelined request) wait for the answer, outside
the body budget: so reading stops once `PIPELINED_BYTES` of them are held, and the rest
waits in the socket (the client's sends block) until the answer is out. A client
that half-closes after its request still gets its answer. Answers are written by
`FastReply` (router/ingress/fast_reply.py). A client that goes away cancels its
request, as aiohttp's `handler_cancellation` does. A connection idle for `keepalive`
seconds is closed (one timer per idle period, re-armed lazily).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from multidict import CIMultiDictProxy

from router import log
from router.errors import INTERNAL, KvrouteError
from router.ingress.fast_body import BodyReceiver, WholeBody
from router.ingress.fast_idle import IdleTimer
from router.ingress.fast_reply import FastReply
from router.ingress.fast_request import ROUTES, Limits, common_request
from router.ingress.tls_door import TlsDoor
from router.ingress.web import (
    LINGER_SECONDS,
    REQUEST_ID,
    HttpIngress,
    request_id,
    watch_half_closed,
)
from router.request import Kind
from router.upstream.flow import FlowProtocol

__all__ = ["ROUTES", "FastConnection", "FastConnections", "FastReply", "FastSite"]

_INTERNAL = KvrouteError(INTERNAL)
#: bytes sent ahead of an answer that a connection holds before it stops reading (one
#: read more may come in): room for a pipelined request's head, not for its body
PIPELINED_BYTES = 64 * 1024


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
        self.limits = Limits.of(parser_limits)
        self.open: set[FastConnection] = set()
        self.closing = False

    def __call__(self) -> FastConnection:
        return FastConnection(self)

    async def drain(self, timeout: float) -> None:
        """Close idle connections now; let requests in flight finish within `timeout`,
        then cut what is left. Their answers say `Connection: close`. The dispatcher's
        drain deadline comes first (router/control/request_path.py): by this one, what is left is an
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


class FastConnection(FlowProtocol):
    """One client connection while the fast path holds it: one request at a time.

    Whole past ~150 lines by design: it is asyncio's protocol for the connection, whose
    callbacks share the request's state (`task`, `_receiving`, `_pending`, `_reply`) on
    every read (a split would add a call per read)."""

    __slots__ = (
        "_closing",
        "_idle",
        "_owner",
        "_pending",
        "_receiving",
        "_reply",
        "task",
    )

    def __init__(self, owner: FastConnections) -> None:
        super().__init__(asyncio.get_running_loop())
        self._owner = owner
        self.task: asyncio.Task | None = None
        self._pending = b""  # bytes that came while a request was being answered
        self._receiving: BodyReceiver | None = None  # a body still coming, or lingering
        self._reply: FastReply | None = None  # the answer of the request being served
        self._closing = False  # close once the current answer is out
        self._idle = IdleTimer(self._loop, owner.keepalive, self._busy, self.close)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._owner.open.add(self)
        self._idle.start()

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self._owner.open.discard(self)
        self.body_received()
        self._idle.cancel()
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

    @property
    def pipelined(self) -> int:
        """Bytes read ahead of the answer being served (a pipelined request's)."""
        return len(self._pending)

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
            if len(self._pending) >= PIPELINED_BYTES:
                self.pause_reading()  # until this answer is out
            return
        self._process(data)

    def _process(self, data: bytes) -> None:
        """Serve `data` if it starts one common request, else hand it to aiohttp."""
        owner = self._owner
        request = common_request(data, owner.limits, owner.max_body)
        if request is None or owner.closing:
            self._hand_over(data)
            return
        arrived = request.arrived
        if len(arrived) == request.length:
            body: Callable[[], Awaitable[bytes]] = WholeBody(arrived, owner.ingress.bodies)
        else:  # still coming (e.g. a client that writes head and body apart): read on demand
            body = self._receiving = BodyReceiver(self, owner, self._loop, arrived, request.length)
            self.pause_reading()
        self._closing = request.should_close
        self.task = self._loop.create_task(
            self._serve(request.kind, request.path, request.headers, body)
        )

    def body_received(self) -> None:
        """The body being received is whole, or no longer wanted."""
        if self._receiving is not None:
            self._receiving.stop()
        self._receiving = None

    async def _serve(
        self,
        kind: Kind,
        path: str,
        headers: CIMultiDictProxy[str],
        read_body: Callable[[], Awaitable[bytes]],
    ) -> None:
        reply = self._reply = FastReply(self)
        try:
            await self._owner.ingress.serve(kind, "POST", path, headers, read_body, reply)
        except (ConnectionError, asyncio.CancelledError):
            self._closing = True
        except Exception:  # a bug of ours: aiohttp would answer 500 and log it too
            self._closing = True
            await _internal_error(reply, path, headers)
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
        self._idle.start()
        if self.reading_paused:
            self.resume_reading()
        if self._pending:
            data, self._pending = self._pending, b""
            self._process(data)

    # what FastReply asks of its connection
    def closes(self) -> bool:
        """The answer says `Connection: close`: the client asked, the router drains, or
        a body left unread (a refusal before it) is not worth the connection."""
        return self._closing or self._owner.closing or self._receiving is not None

    def close_after_answer(self) -> None:
        self._closing = True

    def _busy(self) -> bool:
        return self.task is not None or self._receiving is not None

    def _hand_over(self, data: bytes) -> None:
        """aiohttp's server takes the connection, starting from `data`, for good."""
        transport = self.transport
        if transport is None:
            return
        self._owner.open.discard(self)
        self._idle.cancel()
        self.transport = None
        _hand_over(transport, self._owner.fallback(), data, self.writing_paused)


async def _internal_error(reply: FastReply, path: str, headers: CIMultiDictProxy[str]) -> None:
    """Log a bug of ours met serving `path`; answer 500 if the answer had not begun."""
    log.http.exception("error handling POST %s", path)
    if not reply.started:
        extra = {REQUEST_ID: request_id(headers)}
        with contextlib.suppress(ConnectionError):
            await reply.whole(500, *_INTERNAL.http_answer(extra))


def _hand_over(
    transport: asyncio.Transport, handler: asyncio.Protocol, data: bytes, paused: bool
) -> None:
    """`handler` (aiohttp's) takes `transport` as if it had been its own from the start,
    and reads `data` first; `paused`: the socket's buffer is full."""
    transport.set_protocol(handler)
    handler.connection_made(transport)
    handler.data_received(data)
    if paused:
        handler.pause_writing()


class FastSite(web.TCPSite):
    """aiohttp's TCP site, listening with the fast path in front of aiohttp's server
    (over TLS when given an `ssl_context`)."""

    def __init__(self, runner: web.AppRunner, fast: FastConnections, **kwargs) -> None:
        super().__init__(runner, **kwargs)
        self._fast = fast

    async def start(self) -> None:
        self._runner._reg_site(self)
        protocol: Callable[[], asyncio.Protocol] = self._fast
        if self._ssl_context is not None:  # TLS under both: aiohttp takes over the transport
            # the door answers plain HTTP with a 400; the handshake and the wait for it get
            # the header timeout (asyncio's default is 60 s): a client that stalls them
            # holds a connection no longer than one that stalls its head
            context, timeout = self._ssl_context, self._fast.keepalive
            protocol = functools.partial(TlsDoor, self._fast, context, timeout)
        self._server = await asyncio.get_running_loop().create_server(
            protocol,
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
