"""One upstream exchange: original bytes out, response bytes back untouched.

`open_upstream` writes the client's body and headers (hop-by-hop headers dropped) on a
keep-alive connection from `Upstreams` (router/upstream/pool.py) and returns an
`Upstream` once the backend's status and headers arrived. Its body is then read whole
(JSON answers) or chunk by chunk as the backend flushes it (SSE): nothing is decoded or
re-encoded, and nothing is buffered (but for the answer of a model a pool's `model_map`
renamed, whose `model` is given back the client's name: `Upstream.answer_as`).
Upstream failures are translated here and only here, so a failure writing to the
*client* can never pass for a backend error.

Why not aiohttp's client on this path: per request it builds a request object, a
payload object, a response object, merges default headers and asks the cookie jar and
trace hooks - about 30% of the router's CPU per request in the profile, to write
bytes we already have. The request head and body go out in one call; the answer is
parsed by httptools (router/upstream/response.py), a chunked body by `ChunkedBody`
(router/upstream/chunked.py), so a relay (router/upstream/relay.py) can pass reads of
whole chunks on as they came. Health checks, telemetry and /tokenize keep the aiohttp
session (`make_session`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client import Histogram
from yarl import URL

from router import log
from router.errors import UpstreamDisconnected, UpstreamError
from router.fleet.backend import Backend
from router.upstream.body import BodyReader
from router.upstream.chunked import ChunkedBody
from router.upstream.clock import BodyClock, Framed
from router.upstream.connection import _Connection
from router.upstream.failures import BackendBroke, Malformed
from router.upstream.pool import Upstreams
from router.upstream.relay import Relay, Sink
from router.upstream.rename import ModelRename, RenamingSink
from router.upstream.response import Head
from router.upstream.usage import Usage, usage

__all__ = [
    "HOP_BY_HOP",
    "Sink",
    "Upstream",
    "Upstreams",
    "forward_headers",
    "header_lines",
    "make_session",
    "open_upstream",
]

#: methods that send no Content-Length when they have no body (as aiohttp's client)
_BODYLESS = frozenset({"GET", "HEAD", "OPTIONS", "CONNECT", "TRACE"})

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


class Upstream:
    """A backend response whose headers arrived; its body is read through this object."""

    __slots__ = (
        "_clock",
        "_conn",
        "_loop",
        "_payload",
        "_rename",
        "backend_name",
        "headers",
        "pool",
        "status",
        "streaming",
    )

    def __init__(
        self,
        conn: _Connection,
        message: Head,
        payload: BodyReader,
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
        self._clock = BodyClock(self._loop, idle, end, itl, on_first)
        self._rename: ModelRename | None = None
        self.backend_name = ""
        #: the backend's pool (None in a flat fleet): the answer's x-kvroute-pool
        self.pool: str | None = None
        self.status: int = message.status
        self.headers: CIMultiDictProxy[str] = message.headers
        media_type = self.headers.get("Content-Type", "").partition(";")[0]
        self.streaming = media_type.strip().lower() == "text/event-stream"

    @property
    def first_chunk_at(self) -> float | None:
        """When the body's first chunk came (the prefill was done), if it did."""
        return self._clock.first_chunk_at

    def decoding(self) -> tuple[int, float]:
        """The body's chunks after its first, and the seconds they took."""
        return self._clock.decoding()

    def second_chunk(self) -> float | None:
        """Seconds from the body's first chunk to its second (None before it)."""
        return self._clock.second_chunk()

    def watch(self, deadline: asyncio.Timeout) -> None:
        """The timeout guarding the body; once chunks flow, it expires `idle` seconds
        after the last one (and at `end` at the latest)."""
        self._clock.watch(deadline)

    def answer_as(self, served: str, asked: str) -> None:
        """The backend serves the model asked for as `served` (a pool's `model_map`):
        its answer, read any way, names `asked` instead (router/upstream/rename.py)."""
        self._rename = ModelRename(served, asked)

    async def read(self) -> bytes:
        try:
            body = await self._payload.read()
        except BackendBroke as exc:
            raise UpstreamDisconnected(broke(exc, "answer")) from exc
        self._clock.tail = body if self._rename is None else self._rename.whole(body)
        return self._clock.tail

    def keep(self) -> None:
        """Keep the whole body for `body` (a captured answer): called before it is read."""
        self._clock.kept = []

    @property
    def kept(self) -> bool:
        return self._clock.kept is not None

    def body(self) -> bytes:
        """The body read so far, when it is kept: a stream's chunks joined, or the whole
        answer `read` returned."""
        kept = self._clock.kept
        return unframed(kept) if kept and self.streaming else self._clock.tail

    def usage(self) -> Usage:
        """The token counts the answer reported (router/upstream/usage.py).

        Streams report usage in their last event, so only the last chunk is kept (by
        reference) and searched once, at the end; a chunk too short to hold usage (the
        `data: [DONE]` read apart from the usage event) does not replace it.
        """
        return usage(self._clock.tail)

    async def chunks(self) -> AsyncIterator[bytes]:
        """Yield data as the backend flushes it; each chunk extends the idle deadline.

        The gaps between chunks go to the inter-token latency histogram `itl` when the
        exchange finishes; `on_first` hears the first chunk (the prefill is done).
        """
        clock, payload, rename = self._clock, self._payload, self._rename
        clock.begin()
        while True:
            try:
                chunk = await payload.readany()
            except BackendBroke as exc:
                raise UpstreamDisconnected(broke(exc, "stream")) from exc
            if not chunk:  # clean end; a cut-off body raises above
                if rename is not None and (rest := rename.rest()):
                    yield rest
                return
            clock.arrived(chunk)
            if rename is None:
                yield chunk
            elif out := rename.feed(chunk):
                yield out

    async def relay(self, sink: Sink) -> None:
        """Stream the body into `sink` as `chunks` would, but from the connection's own
        callback (router/upstream/relay.py). Returns at the body's end."""
        self._clock.begin()
        renaming = None if self._rename is None else RenamingSink(sink, self._rename)
        relay = Relay(self._payload, renaming or sink, self._clock, self._loop, _stream_broke)
        self._conn.relay = relay
        sink.on_ready(relay.drain)
        try:
            relay.drain()  # what came with the head
            await relay.done
            if renaming is not None:
                renaming.end()
        finally:
            self._conn.relay = None
            sink.on_ready(None)

    def finish(self, clean: bool) -> None:
        """Keep the connection for the next request, or close it so the backend aborts."""
        self._clock.stop()
        self._conn.release(clean)


def unframed(kept: list[bytes]) -> bytes:
    """A kept stream's body: its reads joined, the relay's framed ones decoded (each is
    whole chunks, so each takes a decoder of its own)."""
    pieces: list[bytes] = []
    for piece in kept:
        if isinstance(piece, Framed):
            pieces.extend(ChunkedBody().feed(piece)[0])
        else:
            pieces.append(piece)
    return b"".join(pieces)


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
        tls = None if own is None else own.tls
        conn, message, payload = await upstreams.send(
            backend, head, body, method, connect_timeout, tls
        )
    except Malformed as exc:
        raise UpstreamError(_logged("The backend answered with malformed HTTP.", exc)) from exc
    except BackendBroke as exc:  # closed or reset
        told = "The backend closed the connection before answering."
        raise UpstreamError(_logged(told, exc)) from exc
    return Upstream(conn, message, payload, idle, end, itl, on_first)


def _stream_broke(exc: BackendBroke) -> UpstreamDisconnected:
    return UpstreamDisconnected(broke(exc, "stream"))


def broke(exc: BackendBroke, what: str) -> str:
    """How the backend failed the `what` it was sending, in the client's terms."""
    if isinstance(exc, Malformed):
        return _logged(f"The backend sent a malformed {what}.", exc)
    return _logged(f"The backend broke off the {what}.", exc)


def _logged(told: str, exc: BaseException) -> str:
    """`told`, what the client hears of a backend failure; the connection's own words
    for it go to the log, at debug, on this error path only."""
    log.backends.debug("%s (%r)", told, exc)
    return told


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
