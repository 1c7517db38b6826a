"""The answer relayed: the backend's answer to a `Call`, whole or streamed, or the
failure. Before the first byte reaches the client a failure is an OpenAI-style JSON
error; after it, an error event and `[DONE]` end the stream. An answer from a backend,
and a 502/504 about one, names it in x-kvroute-backend (and its pool, in a fleet with
pools, in x-kvroute-pool).

`Reply` is where an answer goes, whichever server read the request: aiohttp's
(`AiohttpReply`) or the fast path's (router/ingress/fast.py). `EncodedReply` wraps
either when the client accepts a coding the router offers (router/ingress/compression.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Protocol

from aiohttp import web
from aiohttp.hdrs import SERVER
from multidict import CIMultiDict

from router.dispatch.dispatcher import Call, Dispatcher
from router.errors import (
    BodyBudgetFull,
    KvrouteError,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
    UpstreamError,
)
from router.ingress.compression import Coding, StreamEncoder
from router.ingress.usage_strip import WithoutUsage
from router.upstream.proxy import Sink, Upstream, forward_headers
from router.upstream.relay import TransformingSink

BACKEND_HEADER = "x-kvroute-backend"
POOL_HEADER = "x-kvroute-pool"
#: why the backend was picked, when `flow.reason_header` is on
REASON_HEADER = "x-kvroute-reason"
#: a whole answer this long or longer is compressed in a thread, off the event loop (zlib
#: and zstd let go of the GIL): about a millisecond of gzip, which every stream the
#: worker relays would otherwise wait out
THREAD_BYTES = 64 * 1024


class Reply(Protocol):
    """Where one request's answer goes: whole, or as a stream (begin, send..., end)."""

    started: bool  # the status line left: an error can only end the stream now
    sink: Sink | None  # where Upstream.relay may write a stream directly, if anywhere

    async def whole(
        self, status: int, headers: Mapping[str, str], body: bytes, close: bool = False
    ) -> None: ...

    async def begin(self, status: int, headers: Mapping[str, str]) -> None: ...

    def send(self, chunk: bytes) -> Awaitable[None] | None:
        """Write `chunk`; returns something to await when the client must catch up."""

    async def end(self) -> None: ...


class AiohttpReply:
    """A Reply through aiohttp's server: the handler returns `response`."""

    __slots__ = ("_request", "response", "started")

    sink = None  # aiohttp's writes are coroutines: chunks are awaited one by one

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response = web.StreamResponse()
        self.started = False

    async def whole(
        self, status: int, headers: Mapping[str, str], body: bytes, close: bool = False
    ) -> None:
        self.response = web.Response(status=status, body=body, headers=headers)
        if close:
            self.response.force_close()

    async def begin(self, status: int, headers: Mapping[str, str]) -> None:
        self.response = web.StreamResponse(status=status, headers=headers)
        self.started = True
        await self.response.prepare(self._request)

    def send(self, chunk: bytes) -> Awaitable[None]:
        return self.response.write(chunk)

    async def end(self) -> None:
        await self.response.write_eof()


class EncodedReply:
    """A Reply whose answer `coding` compresses on its way to `reply`: a whole answer of
    at least `coding.min_bytes`, or a stream, each chunk flushed through the encoder
    as it comes (from the backend connection's callbacks, through an `EncodedSink`,
    when `reply` has a sink). An answer that has a Content-Encoding of its own, or a
    type that is not text, goes as it is."""

    __slots__ = ("_coding", "_encoder", "_reply")

    def __init__(self, reply: Reply, coding: Coding) -> None:
        self._reply = reply
        self._coding = coding
        self._encoder: StreamEncoder | None = None

    @property
    def started(self) -> bool:
        return self._reply.started

    @property
    def sink(self) -> Sink | None:
        """Once the stream began: `reply`'s sink, through the encoder if it compresses."""
        inner = self._reply.sink
        if inner is None or self._encoder is None:
            return inner
        return EncodedSink(inner, self._encoder)

    async def whole(
        self, status: int, headers: Mapping[str, str], body: bytes, close: bool = False
    ) -> None:
        coding = self._coding
        if len(body) >= coding.min_bytes and compressible(headers):
            body = await _compressed(coding, body)
            headers = _encoded(headers, coding.name)
        await self._reply.whole(status, headers, body, close)

    async def begin(self, status: int, headers: Mapping[str, str]) -> None:
        if compressible(headers):
            self._encoder = self._coding.stream()
            headers = _encoded(headers, self._coding.name)
        await self._reply.begin(status, headers)

    def send(self, chunk: bytes) -> Awaitable[None] | None:
        if self._encoder is not None and chunk:
            chunk = self._encoder.compress(chunk)
        return self._reply.send(chunk)

    async def end(self) -> None:
        if self._encoder is not None:
            await _send(self._reply, self._encoder.finish())
        await self._reply.end()


class EncodedSink(TransformingSink):
    """A Sink that compresses what it passes to `inner`, each chunk flushed on its own."""

    __slots__ = ("_encoder",)

    def __init__(self, inner: Sink, encoder: StreamEncoder) -> None:
        super().__init__(inner)
        self._encoder = encoder

    def put(self, chunk: bytes) -> None:
        if chunk:
            self._inner.put(self._encoder.compress(chunk))


def compressible(headers: Mapping[str, str]) -> bool:
    """Whether an answer is the router's to compress: no coding of its own, and text
    (JSON, SSE, text/*), not audio or another coded format."""
    if "Content-Encoding" in headers:
        return False
    media_type = headers.get("Content-Type", "").partition(";")[0].strip().lower()
    return media_type.startswith("text/") or media_type.endswith("json")


def _encoded(headers: Mapping[str, str], coding: str) -> CIMultiDict[str]:
    """The headers of an answer compressed with `coding`, which caches key by the
    request's Accept-Encoding as well."""
    out = CIMultiDict(headers)
    out["Content-Encoding"] = coding
    out.add("Vary", "Accept-Encoding")
    return out


async def _compressed(coding: Coding, body: bytes) -> bytes:
    """`body` compressed: in the event loop when short, else in a thread."""
    if len(body) < THREAD_BYTES:
        return coding.whole(body)
    return await asyncio.get_running_loop().run_in_executor(None, coding.whole, body)


async def relay(dispatcher: Dispatcher, call: Call, reply: Reply, extra: dict[str, str]) -> None:
    """Hand `call` to dispatch and relay the backend's answer (or the failure) on
    `reply`, with the `extra` headers."""
    try:
        async with dispatcher.exchange(call) as upstream:
            extra[BACKEND_HEADER] = upstream.backend_name
            if upstream.pool is not None:
                extra[POOL_HEADER] = upstream.pool
            if call.decision:
                extra[REASON_HEADER] = call.decision
            if not upstream.streaming:
                body = await upstream.read()
                await reply.whole(upstream.status, _headers(upstream, extra), body)
                return
            call.began = True
            await reply.begin(upstream.status, _headers(upstream, extra))
            if call.strip_usage:
                await _without_usage(upstream, reply)
            elif reply.sink is not None:
                await upstream.relay(reply.sink)
            else:
                async for chunk in upstream.chunks():
                    await _send(reply, chunk)
            await reply.end()
    except KvrouteError as err:
        if not reply.started:
            await refuse(reply, err, extra)
            return
        await _end_stream_with(reply, err)
    except ConnectionResetError:
        if not reply.started:
            raise
        # the client left mid-stream: a 499, and no traceback to log


async def _without_usage(upstream: Upstream, reply: Reply) -> None:
    """Relay a stream whose usage event the router asked for, without that event."""
    stripped = WithoutUsage()
    async for chunk in upstream.chunks():
        if out := stripped.feed(chunk):
            await _send(reply, out)
    if rest := stripped.rest():
        await _send(reply, rest)


async def _send(reply: Reply, chunk: bytes) -> None:
    """Write `chunk`, waiting while the client catches up."""
    full = reply.send(chunk)
    if full is not None:
        await full


async def refuse(reply: Reply, err: KvrouteError, extra: dict[str, str]) -> None:
    """Answer with `err` before anything of an answer was sent (refused, or failed)."""
    if isinstance(err, Unauthorized):
        extra = {**extra, "WWW-Authenticate": "Bearer"}
    elif isinstance(err, UpstreamError) and err.backend is not None:
        extra = {**extra, BACKEND_HEADER: err.backend}  # the one that failed, tried last
        if err.pool is not None:
            extra[POOL_HEADER] = err.pool
    headers, body = err.http_answer(extra)
    # refused before its body was read whole (a 401 on the head, a 413, a 408, a full
    # body budget): the rest of the body is not worth the connection
    unread = isinstance(err, (Unauthorized, PayloadTooLarge, RequestTimeout, BodyBudgetFull))
    await reply.whole(err.status, headers, body, unread)


async def refused(request: web.Request, err: KvrouteError) -> web.StreamResponse:
    """The answer of an aiohttp handler that refuses `request` with `err`."""
    reply = AiohttpReply(request)
    await refuse(reply, err, {})
    return reply.response


async def _end_stream_with(reply: Reply, err: KvrouteError) -> None:
    """A stream that already started ends with an error event and [DONE], never a hang."""
    try:
        full = reply.send(b"\n\n" + err.sse_event())
        if full is not None:
            await full
        await reply.end()
    except ConnectionError:
        pass  # the client is gone too; nothing left to tell


def _headers(upstream: Upstream, extra: dict[str, str]) -> CIMultiDict[str]:
    """The answer's headers: the backend's, without its Server, and the router's."""
    headers = forward_headers(upstream.headers)
    headers.popall(SERVER, None)  # the backend's software is not the client's business
    headers.update(extra)
    return headers
