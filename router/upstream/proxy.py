"""One upstream exchange: original bytes out, response bytes back untouched.

`open_upstream` writes the client's body and headers (hop-by-hop headers dropped) on a
keep-alive connection from `Upstreams` and returns an `Upstream` once the backend's
status and headers arrived. Its body is then read whole (JSON answers) or chunk by chunk
as the backend flushes it (SSE): nothing is decoded or re-encoded, and nothing is
buffered. Upstream failures are translated here and only here, so a failure writing to
the *client* can never pass for a backend error.

Why not aiohttp's client on this path: per request it builds a request object, a
payload object, a response object, merges default headers and asks the cookie jar and
trace hooks - about 30% of the router's CPU per request in the profile, to write
bytes we already have. `Upstreams` writes the request head and body in one call and
parses the answer with aiohttp's own C parser into aiohttp's own StreamReader, exactly
as aiohttp's client does underneath; a chunked body is decoded by `ChunkedBody`
(router/upstream/chunked.py) instead, so a relay can pass reads of whole chunks on as they came.
Health checks, telemetry and /tokenize keep the aiohttp session (`make_session`).
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

import aiohttp
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http import HttpResponseParser, RawResponseMessage
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client import Histogram
from yarl import URL

from router import log
from router.errors import UpstreamConnectError, UpstreamDisconnected, UpstreamError
from router.fleet.backend import Backend
from router.metrics import Tally
from router.upstream.chunked import ChunkedBody, ChunkError

_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
#: methods that send no Content-Length when they have no body (as aiohttp's client)
_BODYLESS = frozenset({"GET", "HEAD", "OPTIONS", "CONNECT", "TRACE"})
#: methods sent again, once, when a reused connection turns out closed (as aiohttp's client)
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
_INTERIM = range(100, 200)  # 1xx answers precede the final one (101 is final: an upgrade)
_NO_BODY_STATUS = frozenset({204, 304})
_TAIL_MIN = 32  # bytes: shorter chunks (`data: [DONE]`, framed or not) hold no usage
_READ_LIMIT = 2**16  # body bytes buffered before the socket pauses (aiohttp's default)
KEEPALIVE_SECONDS = 60.0  # an idle connection is closed after this long

#: RFC 9110 §7.6.1's hop-by-hop fields, plus what the router makes itself for the next
#: hop (Host, the framing) and Expect, which it answered (the body goes whole)
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",
    }
)


def forward_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """Headers safe to pass across the proxy (end-to-end ones only): the hop-by-hop
    ones, and those the Connection header names as such (RFC 9110 §7.6.1).

    A C-level copy, then a lookup per hop-by-hop name: a third of the cost of testing
    each header in Python, which runs twice per request.
    """
    out = CIMultiDict(headers)
    named = out.getall("Connection", ())
    for name in HOP_BY_HOP:
        if name in out:
            del out[name]
    for value in named:
        for option in value.split(","):
            out.popall(option.strip(), None)
    return out


def make_session(connect_timeout: float) -> aiohttp.ClientSession:
    """The pooled session beside the request path (health checks, model polls, telemetry,
    /tokenize): keep-alive, no limit, bytes untouched."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


class Sink(Protocol):
    """Where `Upstream.relay` writes a streamed body (the fast path's client connection)."""

    def put(self, chunk: bytes) -> None:
        """Write `chunk`; ConnectionError if the client is gone."""

    def ready(self) -> bool:
        """False while the client's socket buffer is full."""

    def put_framed(self, chunks: bytes) -> None:
        """Write whole chunks already framed for chunked transfer encoding, as they are."""

    def on_ready(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` when the client's buffer drains again (None: stop)."""


class Upstream:
    """A backend response whose headers arrived; its body is read through this object."""

    __slots__ = (
        "_conn",
        "_deadline",
        "_draining",
        "_end",
        "_idle",
        "_idle_timer",
        "_itl",
        "_last_chunk_at",
        "_loop",
        "_on_first",
        "_payload",
        "_refilled",
        "_relayed",
        "_sink",
        "_tail",
        "_taken",
        "_tally",
        "backend_name",
        "first_chunk_at",
        "headers",
        "status",
        "streaming",
    )

    def __init__(
        self,
        conn: _Connection,
        message: RawResponseMessage,
        payload: StreamReader,
        idle: float,
        end: float,
        itl: Histogram,
        on_first: Callable[[], None],
    ) -> None:
        self._conn = conn
        # asked once: on Python 3.11 every asyncio.get_running_loop() is a getpid() system
        # call, which per SSE event was a third of a streaming worker's system calls
        self._loop = asyncio.get_running_loop()
        self._payload = payload
        self._on_first = on_first
        self._deadline: asyncio.Timeout | None = None
        self._idle = idle
        self._end = end
        self._idle_timer: asyncio.TimerHandle | None = None
        self._itl = itl
        self._tally: Tally | None = None
        self._sink: Sink | None = None
        self._relayed: asyncio.Future[None] | None = None
        self._draining = False
        self._refilled = False
        self._taken = 0  # body bytes the relay took from the reader
        self.first_chunk_at: float | None = None
        self._last_chunk_at = 0.0
        self._tail = b""
        self.backend_name = ""
        self.status: int = message.code
        self.headers: CIMultiDictProxy[str] = message.headers
        media_type = self.headers.get("Content-Type", "").partition(";")[0]
        self.streaming = media_type.strip().lower() == "text/event-stream"

    def watch(self, deadline: asyncio.Timeout) -> None:
        """The timeout guarding the body; once chunks flow, it expires `idle` seconds
        after the last one (and at `end` at the latest)."""
        self._deadline = deadline

    async def read(self) -> bytes:
        try:
            self._tail = await self._payload.read()
        except aiohttp.ClientError as exc:
            raise UpstreamDisconnected(_broke(exc, "answer")) from exc
        return self._tail

    def cached_tokens(self) -> int | None:
        """`usage.prompt_tokens_details.cached_tokens` of the answer, if it reported one.

        Streams report usage in their last event, so only the last chunk is kept (by
        reference) and searched once, at the end; a chunk too short to hold usage (the
        `data: [DONE]` read apart from the usage event) does not replace it.
        """
        found = _CACHED_TOKENS.search(self._tail)
        return int(found.group(1)) if found else None

    async def chunks(self) -> AsyncIterator[bytes]:
        """Yield data as the backend flushes it; each chunk extends the idle deadline.

        The gaps between chunks go to the inter-token latency histogram `itl` when the
        exchange finishes; `on_first` hears the first chunk (the prefill is done).
        """
        loop = self._loop
        self._begin_body()
        payload = self._payload
        while True:
            try:
                chunk = await payload.readany()
            except aiohttp.ClientError as exc:
                raise UpstreamDisconnected(_broke(exc, "stream")) from exc
            if not chunk:  # clean end; a cut-off body raises ClientPayloadError above
                return
            self._arrived(chunk, loop.time())
            yield chunk

    async def relay(self, sink: Sink) -> None:
        """Stream the body into `sink` as `chunks` would, but from the connection's own
        callback: no task wake-up, future or generator step per chunk (the hot loop of a
        streaming worker). While the sink is not ready, the body waits in the reader,
        whose limit pauses the backend's socket. Returns at the body's end."""
        self._begin_body()
        self._sink = sink
        self._relayed = self._loop.create_future()
        self._conn.relay = self
        sink.on_ready(self.drain)
        try:
            self.drain()  # what came with the head
            await self._relayed
        finally:
            self._conn.relay = None
            sink.on_ready(None)

    def drain(self) -> None:
        """Pass what the reader holds to the sink; note the end or the failure.

        Reading may resume the paused socket, whose buffered bytes then come back here
        through `data_received`: that nested call only notes the refill, and the loop
        reads again (so one event costs one read of the reader, not two).
        """
        done = self._relayed
        if done is None or done.done():
            return
        if self._draining:
            self._refilled = True
            return
        payload, sink, now = self._payload, self._sink, self._loop.time
        self._draining = True
        try:
            while sink.ready():
                self._refilled = False
                chunk = payload.read_nowait(-1)
                if chunk:
                    self._taken += len(chunk)
                    self._arrived(chunk, now())
                    sink.put(chunk)
                if not self._refilled:
                    break
            if payload.at_eof():
                done.set_result(None)
        except aiohttp.ClientError as exc:
            done.set_exception(UpstreamDisconnected(_broke(exc, "stream")))
        except ConnectionError as exc:  # the client is gone
            done.set_exception(exc)
        finally:
            self._draining = False

    def forward(self, chunks: bytes) -> bool:
        """Pass a read of whole chunks to the sink as the backend framed them, if nothing
        waits before it in the reader and the sink takes it now (a stream's hot path:
        nothing decoded or framed again); False: the caller puts it in the reader."""
        done = self._relayed
        if (
            self._draining
            or done is None
            or done.done()
            or self._payload.total_bytes != self._taken
            or not self._sink.ready()
        ):
            return False
        if chunks:
            self._arrived(chunks, self._loop.time())
            try:
                self._sink.put_framed(chunks)
            except ConnectionError as exc:  # the client is gone
                done.set_exception(exc)
        return True

    def _begin_body(self) -> None:
        assert self._deadline is not None, "watch() the body's timeout before reading it"
        self._tally = Tally(self._itl)

    def _arrived(self, chunk: bytes, now: float) -> None:
        if self.first_chunk_at is None:
            self.first_chunk_at = now
            self._on_first()
            self._deadline.reschedule(None)  # the idle timer decides from here on
            self._arm_idle_timer(now + self._idle)
        else:
            self._tally.observe(now - self._last_chunk_at)
        self._last_chunk_at = now
        if len(chunk) > _TAIL_MIN:
            self._tail = chunk

    def _arm_idle_timer(self, due: float) -> None:
        """Expire the body's timeout at `due` (never after `end`) unless a chunk comes.

        A chunk only notes its time: this one timer wakes at the deadline it was set for and,
        if a chunk came since, sleeps on until the new one. So a stream costs a timer per
        idle period, not a reschedule (a timer cancelled and another created) per chunk.
        """
        loop = self._loop
        due = min(due, self._end)
        if due > loop.time():
            self._idle_timer = loop.call_at(due, self._on_idle_timer)
        else:
            self._idle_timer = None
            self._deadline.reschedule(due)  # in the past: asyncio's timeout expires now

    def _on_idle_timer(self) -> None:
        self._arm_idle_timer(self._last_chunk_at + self._idle)

    def finish(self, clean: bool) -> None:
        """Keep the connection for the next request, or close it so the backend aborts."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._tally is not None:
            self._tally.flush()
        self._conn.release(clean)


async def open_upstream(
    upstreams: Upstreams,
    backend: URL,
    target: str,
    method: str,
    body: bytes,
    headers: CIMultiDict[str],
    connect_timeout: float,
    idle: float,
    end: float,
    itl: Histogram,
    on_first: Callable[[], None],
    own: Backend | None = None,
) -> Upstream:
    """Send the request for `target` (path and query, as the client sent them) to
    `backend` and return its answer once the status and headers arrived. `own` adds the
    backend's own headers (its API key, extra headers) in place of any the client sent."""
    if own is not None and own.headers:
        headers, lines = _without(headers, own.headers), own.head_lines
    else:
        lines = ""
    head = _head(method, target, backend, headers, body, lines)
    try:
        conn, message, payload = await upstreams.send(backend, head, body, method, connect_timeout)
    except _Malformed as exc:
        raise UpstreamError(_logged("The backend answered with malformed HTTP.", exc)) from exc
    except aiohttp.ClientError as exc:  # closed or reset
        told = "The backend closed the connection before answering."
        raise UpstreamError(_logged(told, exc)) from exc
    return Upstream(conn, message, payload, idle, end, itl, on_first)


class _Malformed(aiohttp.ClientPayloadError):
    """The backend's bytes are not HTTP, or not the chunked framing they claim."""


def _broke(exc: aiohttp.ClientError, what: str) -> str:
    """How the backend failed the `what` it was sending, in the client's terms."""
    if isinstance(exc, _Malformed):
        return _logged(f"The backend sent a malformed {what}.", exc)
    return _logged(f"The backend broke off the {what}.", exc)


def _logged(told: str, exc: BaseException) -> str:
    """`told`, what the client hears of a backend failure; aiohttp's own words for it
    (library internals) go to the log, at debug, on this error path only."""
    log.backends.debug("%s (%r)", told, exc)
    return told


def _unreachable(exc: OSError) -> str:
    """Why no connection to the backend was made, in the client's terms."""
    if isinstance(exc, ConnectionRefusedError):
        return "The backend refused the connection."
    if isinstance(exc, socket.gaierror):
        return "The backend cannot be reached: its host name does not resolve."
    if isinstance(exc, ssl.SSLError):
        return "The backend cannot be reached: the TLS handshake failed."
    if exc.strerror:  # e.g. "No route to host"
        return f"The backend cannot be reached ({exc.strerror})."
    return "The backend cannot be reached."


def _head_end(carry: bytes, data: bytes) -> int:
    """Where in `data` the blank line ending a head ends, or -1; `carry` holds the last
    bytes (up to 3) of the head before `data`, for a blank line split between reads."""
    if carry:
        edge = (carry + data[:3]).find(b"\r\n\r\n")
        if edge >= 0:
            return edge + 4 - len(carry)
    end = data.find(b"\r\n\r\n")
    return end + 4 if end >= 0 else -1


def header_lines(headers: Mapping[str, str]) -> str:
    """`Name: value` lines, each ending in CRLF; ValueError if a line break hides in one."""
    fields = "\r\n".join(map(": ".join, headers.items()))
    breaks = max(len(headers) - 1, 0)
    if fields.count("\r") != breaks or fields.count("\n") != breaks:
        raise ValueError("a line break in a header would split the message")
    return fields + "\r\n" if fields else ""


def _without(headers: CIMultiDict[str], names: Mapping[str, str]) -> CIMultiDict[str]:
    """`headers` less `names` (a copy only when there is something to drop)."""
    if not any(name in headers for name in names):
        return headers
    headers = headers.copy()
    for name in names:
        headers.popall(name, None)
    return headers


def _head(
    method: str, target: str, backend: URL, headers: CIMultiDict[str], body: bytes, own: str
) -> bytes:
    """The request line and headers, as aiohttp's client writes them, then the
    backend's own header lines."""
    fields = header_lines(headers) + own
    if body or method not in _BODYLESS:
        fields += f"Content-Length: {len(body)}\r\n"
    head = f"{method} {target} HTTP/1.1\r\nHost: {backend.host_port_subcomponent}\r\n{fields}\r\n"
    return head.encode("utf-8", "surrogateescape")


class Upstreams:
    """Keep-alive HTTP/1.1 connections to the backends, for the request path.

    Idle connections wait per backend, the last one returned reused first. One idle
    longer than `KEEPALIVE_SECONDS` is closed (a sweep runs that often while any wait);
    one the backend closed meanwhile is dropped when looked at.
    """

    def __init__(self) -> None:
        self._idle: dict[URL, list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None
        self._sweep: asyncio.TimerHandle | None = None

    async def send(
        self, backend: URL, head: bytes, body: bytes, method: str, connect_timeout: float
    ) -> tuple[_Connection, RawResponseMessage, StreamReader]:
        """Write a request on a connection to `backend`; return the connection, the
        answer's head and its body's reader. Raises UpstreamConnectError or an
        aiohttp.ClientError."""
        retry = method in _IDEMPOTENT
        while True:
            conn = self._reuse(backend)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(backend, connect_timeout)
            try:
                message, payload = await conn.send(head, body, method)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                conn.close()
                if not (reused and retry):
                    raise
                retry = False  # the backend closed it while idle: once more
                continue
            except BaseException:  # a timeout, a client that left: the answer is not wanted
                conn.close()
                raise
            return conn, message, payload

    def keep(self, conn: _Connection) -> None:
        """`conn` ended its exchange cleanly: keep it for the next request."""
        loop = asyncio.get_running_loop()
        conn.idle_since = loop.time()
        self._idle.setdefault(conn.backend, []).append(conn)
        if self._sweep is None:
            self._sweep = loop.call_later(KEEPALIVE_SECONDS, self._close_expired)

    def close(self) -> None:
        """Close every idle connection (those in use close when their exchange ends)."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    def _reuse(self, backend: URL) -> _Connection | None:
        idle = self._idle.get(backend)
        if not idle:
            return None
        oldest = asyncio.get_running_loop().time() - KEEPALIVE_SECONDS
        while idle:
            conn = idle.pop()
            if conn.open and conn.idle_since > oldest:
                return conn
            conn.close()
        return None

    async def _connect(self, backend: URL, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if backend.scheme == "https" else None
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, self, backend),
                    backend.raw_host,
                    backend.port,
                    ssl=tls,
                    server_hostname=backend.raw_host if tls else None,
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"The backend did not accept a connection within {timeout:g} s."
            ) from None
        except OSError as exc:  # refused, unreachable, unknown host, TLS handshake
            raise UpstreamConnectError(_unreachable(exc)) from exc
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _close_expired(self) -> None:
        """Close connections idle for `KEEPALIVE_SECONDS`; look again that much later."""
        self._sweep = None
        oldest = asyncio.get_running_loop().time() - KEEPALIVE_SECONDS
        for backend, idle in list(self._idle.items()):
            for conn in idle:
                if conn.idle_since <= oldest:
                    conn.close()
            idle[:] = [conn for conn in idle if conn.open]
            if not idle:
                del self._idle[backend]
        if self._idle:
            self._sweep = asyncio.get_running_loop().call_later(
                KEEPALIVE_SECONDS, self._close_expired
            )


class _Connection(BaseProtocol):
    """One keep-alive HTTP/1.1 connection to a backend, one request at a time.

    The answer is parsed by aiohttp's C parser, as in aiohttp's own client: its head
    completes `send`'s future and its body flows into a StreamReader, which pauses the
    socket while the reader lags behind.
    """

    __slots__ = (
        "_answer",
        "_carry",
        "_chunked",
        "_head_done",
        "_method",
        "_payload",
        "_should_close",
        "_upstreams",
        "backend",
        "idle_since",
        "relay",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, upstreams: Upstreams, backend: URL) -> None:
        super().__init__(loop)
        self._upstreams = upstreams
        self.backend = backend
        self.idle_since = 0.0
        self._answer: asyncio.Future[tuple[RawResponseMessage, StreamReader]] | None = None
        self._payload: StreamReader | None = None
        self._should_close = False
        self._method = ""
        self._head_done = False  # the final answer's head is parsed
        self._carry = b""  # the last bytes of a head split across reads
        #: the answer's chunked body, decoded here rather than by aiohttp's parser
        self._chunked: ChunkedBody | None = None
        #: the answer whose body is relayed from this protocol's callbacks (Upstream.relay)
        self.relay: Upstream | None = None

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(
        self, head: bytes, body: bytes, method: str
    ) -> asyncio.Future[tuple[RawResponseMessage, StreamReader]]:
        """Write one request; the future gets the answer's head and its body's reader."""
        self._parser = HttpResponseParser(
            self,
            self._loop,
            _READ_LIMIT,
            payload_exception=aiohttp.ClientPayloadError,
            response_with_body=method != "HEAD",
            read_until_eof=True,
            auto_decompress=False,
        )
        self._payload = None
        self._method = method
        self._head_done = False
        self._carry = b""
        self._chunked = None
        self._answer = answer = self._loop.create_future()
        self.transport.writelines((head, body))
        return answer

    def release(self, clean: bool) -> None:
        """The exchange ended: back to the pool if the answer ended cleanly and the
        backend keeps the connection, else closed (a backend aborts what it sends)."""
        payload = self._payload
        if (
            clean
            and self.open
            and not self._should_close
            and payload is not None
            and payload.is_eof()
            and payload.exception() is None
        ):
            self._upstreams.keep(self)
        else:
            self.close()

    def close(self) -> None:
        self._should_close = True
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._chunked is None:
            if self._parser is None:  # lost: nothing more to parse
                return
            if self._head_done or not data:  # b"": resume what the paused parser holds
                self._parse(data, False)
                data = b""
            else:
                data = self._take_head(data)  # what follows the head, if anything
            if self._chunked is None:  # not a chunked body: aiohttp's parser has it all
                if data:
                    self._parse(data, False)
                if self.relay is not None:
                    self.relay.drain()
                return
        if data:
            self._chunk_received(data)

    def _take_head(self, data: bytes) -> bytes:
        """Parse the answer's head (and any interim heads before it) from `data`; return
        the bytes after it. Whether they go to aiohttp's parser or to a ChunkedBody is
        decided by the head, so a chunked head is fed alone; any other answer (a JSON
        body with its length: most of them) is fed whole, as it came."""
        while not self._head_done and self.open:
            end = _head_end(self._carry, data)
            if end < 0:  # all of it is head (or not HTTP: the parser says so)
                self._carry = (self._carry + data)[-3:]
                self._parse(data, False)
                return b""
            self._carry = b""
            if data.find(b"chunked", 0, end) < 0:
                self._parse(data, False)
                return b""
            self._parse(data[:end], True)
            data = data[end:]
            if not data:
                break
        return data

    def _parse(self, data: bytes, head_end: bool) -> None:
        """Feed aiohttp's parser; `head_end`: `data` ends exactly where a head does."""
        try:
            messages, _, _ = self._parser.feed_data(data)
        except Exception as exc:  # not HTTP: nothing more on this connection is trusted
            self.close()
            self._fail(_Malformed(f"invalid answer: {exc}"))
            messages = ()
        for message, payload in messages:
            if message.should_close:
                self._should_close = True
            if message.code in _INTERIM and message.code != 101:
                continue  # e.g. 100 Continue: the final answer follows
            answer = self._answer
            if answer is None or answer.done():  # an answer nobody waits for
                self.close()
                return
            self._head_done = True
            bodyless = message.code in _NO_BODY_STATUS or self._method == "HEAD"
            self._payload = EMPTY_PAYLOAD if message.code in _NO_BODY_STATUS else payload
            if head_end and message.chunked and not bodyless:
                self._chunked = ChunkedBody()
            answer.set_result((message, self._payload))

    def _chunk_received(self, data: bytes) -> None:
        """A chunked body's bytes: passed on as they came when they hold whole chunks and
        a relay can take them now, else decoded into the reader (which pauses the socket
        when it is full)."""
        chunked, payload = self._chunked, self._payload
        if chunked.done:  # bytes after the answer: the connection is not reused
            self._should_close = True
            return
        try:
            pieces, whole = chunked.feed(data)
        except ChunkError as exc:
            self.close()
            self._fail(_Malformed(f"invalid chunked body: {exc}"))
            return
        relay = self.relay
        if relay is None or whole is None or not relay.forward(whole):
            for piece in pieces:
                payload.feed_data(piece)
        elif not chunked.done:
            return  # passed on: nothing waits in the reader
        if chunked.done:
            self._should_close = self._should_close or chunked.overrun
            payload.feed_eof()
        if relay is not None:
            relay.drain()

    def resume_reading(self, resume_parser: bool = True) -> None:
        # aiohttp's StreamReader calls this after every HTTP chunk it hands out, paused or
        # not; only a paused connection (and parser: both pause together) has to resume.
        if self._reading_paused:
            super().resume_reading(resume_parser)

    def eof_received(self) -> None:
        """The backend closed its side: so do we (`connection_lost` follows)."""

    def connection_lost(self, exc: BaseException | None) -> None:
        self._should_close = True
        if self._parser is not None:
            try:
                self._parser.feed_eof()  # ends a body read until close; raises if one was cut
            except Exception as err:
                self._fail(
                    aiohttp.ClientPayloadError(f"Response payload is not completed: {err!r}")
                )
        if exc is None:
            self._fail(aiohttp.ServerDisconnectedError())
        else:
            self._fail(aiohttp.ClientOSError(*exc.args))
        self._parser = None
        self._reading_paused = False  # nothing to resume: readers drain what was buffered
        super().connection_lost(exc)
        if self.relay is not None:
            self.relay.drain()

    def _fail(self, exc: aiohttp.ClientError) -> None:
        """Hand `exc` to whoever waits: for the answer's head, else for its body."""
        answer, payload = self._answer, self._payload
        if answer is not None and not answer.done():
            answer.set_exception(exc)
        elif payload is not None and not payload.is_eof() and payload.exception() is None:
            payload.set_exception(exc)
