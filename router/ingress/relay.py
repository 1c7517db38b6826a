"""The answer relayed: the backend's answer to a `Call`, whole or streamed, or the
failure. Before the first byte reaches the client a failure is an OpenAI-style JSON
error; after it, an error event and `[DONE]` end the stream. An answer from a backend,
and a 502/504 about one, names it in x-kvroute-backend (and its pool, in a fleet with
pools, in x-kvroute-pool).

`Reply` is where an answer goes, whichever server read the request: aiohttp's
(`AiohttpReply`) or the fast path's (router/ingress/fast.py).
"""

from __future__ import annotations

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
from router.ingress.usage_strip import WithoutUsage
from router.upstream.proxy import Sink, Upstream, forward_headers

BACKEND_HEADER = "x-kvroute-backend"
POOL_HEADER = "x-kvroute-pool"


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


async def relay(dispatcher: Dispatcher, call: Call, reply: Reply, extra: dict[str, str]) -> None:
    """Hand `call` to dispatch and relay the backend's answer (or the failure) on
    `reply`, with the `extra` headers."""
    try:
        async with dispatcher.exchange(call) as upstream:
            extra[BACKEND_HEADER] = upstream.backend_name
            if upstream.pool is not None:
                extra[POOL_HEADER] = upstream.pool
            if not upstream.streaming:
                body = await upstream.read()
                await reply.whole(upstream.status, _headers(upstream, extra), body)
                return
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
