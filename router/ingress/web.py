"""aiohttp routes: read and parse the request, hand it to dispatch, write the answer.

Generation endpoints are routed by the policy; the rest of vLLM's OpenAI surface is
proxied to a backend the same way (model-aware, fingerprint-free). `HttpIngress.serve`
answers each of them, whichever server read it; the answer is relayed by relay.py,
JSON whole and SSE chunk by chunk, compressed when `compression` is on and the client
accepts a coding it offers (compression.py). The read-only routes are status.py's.

Hostile clients are refused before any work: the bearer token is checked before the
body is read (auth.py, identity.py: 401); the body must arrive in time and within its
limits (body.py: 408, 413 (one declared larger is refused before a `100 Continue`
invites it), 503); aiohttp enforces the header limits (431) and the header timeout
(`server_limits`). A refusal never reaches dispatch or a backend. With auth on, a path
or method the router does not serve is a 401 too without a valid token, not a 404 or
405 (identity.py's `unrouted`), so a stranger cannot map the routes. Proxied routes
forward the path in origin-form, dot segments resolved (targets.py).

Every answer carries X-Request-Id (the client's, else a new one), including the errors
aiohttp's server makes by itself (`IngressHandler`, `errors_middleware`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.hdrs import SERVER
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.streams import StreamReader
from aiohttp.web_urldispatcher import _default_expect_handler  # aiohttp's 100 Continue
from multidict import CIMultiDict

from router import log
from router.config import Config, LimitsConfig
from router.dispatch.dispatcher import Call, Dispatcher, passable_request_id
from router.errors import (
    INTERNAL,
    BadRequest,
    HeadersTooLarge,
    KvrouteError,
    MetricsUnavailable,
    RequestTimeout,
)
from router.fleet.backends import Fleet
from router.ingress.auth import AdminToken, Authenticator
from router.ingress.body import BodyReader
from router.ingress.compression import Compression
from router.ingress.identity import Identity
from router.ingress.jobs_routes import JobRoutes
from router.ingress.relay import AiohttpReply, EncodedReply, Reply, refuse, relay
from router.ingress.status import StatusRoutes
from router.ingress.targets import origin_form
from router.jobs.runner import JobRunner
from router.metrics import CONTENT_TYPE, Metrics
from router.request import LONG_BODY, NO_FIELDS, Kind, parse
from router.telemetry.loops import Telemetry
from router.upstream.proxy import forward_headers

REQUEST_ID = "X-Request-Id"
LINGER_SECONDS = 2.0  # aiohttp's default, 10 s, lets a slow sender hold a connection
#: aiohttp's message for too many headers (both parsers): it has no exception class
_TOO_MANY_HEADERS = "Too many headers received"
#: how often a client that half-closed is asked whether it still listens, seconds
_PROBE_SECONDS = 0.25
_STILL_THERE = b"HTTP/1.1 100 Continue\r\n\r\n"

#: vLLM OpenAI-surface paths that are proxied but not fingerprinted
_PROXIED = (
    "/v1/responses",
    "/v1/responses/{tail:.*}",
    "/v1/messages",
    "/v1/rerank",
    "/v1/score",
    "/v1/audio/{tail:.*}",
    "/v2/{tail:.*}",
    "/tokenize",
    "/detokenize",
    "/rerank",
    "/score",
    "/pooling",
    "/classify",
    "/invocations",
)


class HttpIngress:
    """The aiohttp app's routes, and `serve`, which answers a proxied request whichever
    server read it."""

    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        dispatcher: Dispatcher,
        metrics: Metrics,
        auth: Authenticator | None = None,
        telemetry: Telemetry | None = None,
        admin_token: AdminToken | None = None,
        workers: int = 1,
        jobs: JobRunner | None = None,
    ):
        self._dispatch = dispatcher
        self._metrics = metrics
        self._auth = auth or Authenticator(config.auth)
        self._who = Identity(self._auth, config.tenant_header, metrics)
        #: the middleware that asks a token of a request no route serves
        self.unrouted = self._who.unrouted
        self._serves_metrics = config.metrics.listen == "data"  # else the admin listener's
        self._body = BodyReader(config.limits, workers)
        self._compression = Compression(config.compression) if config.compression.enabled else None
        #: request bodies held at once: this worker's share of the router's budget
        self.bodies = self._body.bodies
        #: the 408 of a body that did not arrive in time (the fast path's too)
        self.body_late: Callable[[], RequestTimeout] = self._body.late
        self._status = StatusRoutes(
            fleet, dispatcher, self._auth, self._who.tenant, telemetry, admin_token,
            None if jobs is None else jobs.faults,
        )  # fmt: skip
        self._jobs = None
        if jobs is not None:
            limits = config.limits
            self._jobs = JobRoutes(
                config.jobs,
                jobs.store,
                jobs.wake,
                self._who.owner,
                self._body,
                limits.body_timeout,
                metrics,
            )

    def routes(self) -> list[web.RouteDef]:
        body = {"expect_handler": self.expect}  # routes whose body is read
        routed = [
            web.post("/v1/chat/completions", self._handler(Kind.CHAT), **body),
            web.post("/v1/completions", self._handler(Kind.COMPLETION), **body),
            web.post("/v1/embeddings", self._handler(Kind.EMBEDDING), **body),
            *self._status.routes(),
            *(self._jobs.routes() if self._jobs else ()),
        ]
        if self._serves_metrics:
            routed.append(web.get("/metrics", self.metrics))
        other = self._handler(Kind.OTHER)
        routed += [web.route("*", path, other, **body) for path in _PROXIED]
        return routed

    def _handler(self, kind: Kind) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        return functools.partial(self._proxy, kind)

    async def _proxy(self, kind: Kind, request: web.Request) -> web.StreamResponse:
        reply = AiohttpReply(request)
        try:
            path = origin_form(request.raw_path, _route_prefix(request))
        except BadRequest as err:
            rid = request_id(request.headers)
            unread = _unread(kind, request.method, request.raw_path, request.headers, rid)
            await self._refuse(reply, err, {REQUEST_ID: rid}, unread)
            return reply.response
        body = functools.partial(self._body.read, request)
        await self.serve(kind, request.method, path, request.headers, body, reply)
        return reply.response

    async def serve(
        self,
        kind: Kind,
        method: str,
        path: str,
        client_headers: Mapping[str, str],
        read_body: Callable[[], Awaitable[bytes]],
        reply: Reply,
    ) -> None:
        """Answer one proxied request on `reply`, whichever server read it (aiohttp's, or
        the fast path's: router/ingress/fast.py). `read_body` reserves the body's bytes
        in `bodies`; they are given back here once the answer is out."""
        started, arrived = asyncio.get_running_loop().time(), time.perf_counter()
        headers = forward_headers(client_headers)
        rid = request_id(headers)
        headers[REQUEST_ID] = rid
        if self._auth.enabled:
            headers.popall("Authorization", None)  # the router's token stays here
        headers.popall("Content-Encoding", None)  # aiohttp decoded it; the bytes go as read
        if self._compression is not None:
            reply = self._negotiated(headers, reply)
        extra = {REQUEST_ID: rid}
        body, tenant = b"", None
        try:
            try:
                # before the body: no work for strangers
                tenant, token_class = self._who.of(client_headers)
                body = await read_body()
                req = parse(kind, body)
                if len(body) >= LONG_BODY:
                    await asyncio.sleep(0)
                call = Call(kind, req, method, path, body, headers, started, arrived, tenant, rid)
                call.sent_headers, call.token_class = client_headers, token_class
            except KvrouteError as err:
                unread = _unread(kind, method, path, headers, rid, (started, arrived), tenant)
                await self._refuse(reply, err, extra, unread)
                return
            await relay(self._dispatch, call, reply, extra)
        finally:
            self.bodies.give(len(body))

    def _negotiated(self, headers: CIMultiDict[str], reply: Reply) -> Reply:
        """`reply`, compressing the answer if the client accepts a coding offered. The
        client's Accept-Encoding leaves `headers` either way: the router reads the
        backend's answer (usage, capture, the usage strip), so it must come uncoded."""
        coding = self._compression.choose(headers.popall("Accept-Encoding", ()))
        return reply if coding is None else EncodedReply(reply, coding)

    async def _refuse(
        self, reply: Reply, err: KvrouteError, extra: dict[str, str], call: Call
    ) -> None:
        """Refuse a request before it reached dispatch, and count it; `call`: what is
        known of it."""
        self._dispatch.rejected(err, call)
        await refuse(reply, err, extra)

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """Refuse a declared body over the limit before a `100 Continue` invites it: a
        413, and the connection closes with the body unsent. Else aiohttp's answer. What
        this returns bypasses the middlewares: it carries its own X-Request-Id."""
        err = self._body.declared_too_large(request.content_length)
        if err is None:
            try:
                return await _default_expect_handler(request)
            except web.HTTPException as exc:  # 417: an expectation other than 100-continue
                err = KvrouteError(exc.reason, status=exc.status)
        rid = request_id(request.headers)
        unread = _unread(Kind.OTHER, request.method, request.raw_path, request.headers, rid)
        self._dispatch.rejected(err, unread)
        response = err.to_http({REQUEST_ID: rid})
        response.force_close()
        return response

    async def metrics(self, request: web.Request) -> web.Response:
        return await metrics_page(self._metrics)


def _unread(
    kind: Kind,
    method: str,
    path: str,
    headers: Mapping[str, str],
    rid: str,
    arrival: tuple[float, float] | None = None,
    tenant: str | None = None,
) -> Call:
    """What is known of a request refused before its body was read or parsed; `arrival`:
    when it arrived (loop clock, perf_counter), by default now."""
    if arrival is None:
        arrival = (asyncio.get_running_loop().time(), time.perf_counter())
    return Call(kind, NO_FIELDS, method, path, b"", headers, *arrival, tenant, rid)


def request_id(headers: Mapping[str, str]) -> str:
    """The request's id for its answer and its backend: the client's if it is a bounded
    token (passable_request_id), else a new one."""
    return passable_request_id(headers.get(REQUEST_ID))


def _route_prefix(request: web.Request) -> str:
    """What every path of the request's route starts with: `/v2/` for `/v2/{tail}`."""
    return request.match_info.route.resource.canonical.partition("{")[0]


async def metrics_page(metrics: Metrics) -> web.Response:
    """/metrics, on the listener `metrics.listen` names (the admin API's, or this one)."""
    try:
        body = await metrics.render_off_loop()
    except MetricsUnavailable as exc:
        return exc.to_http()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


class _NoClientFaults(logging.Filter):
    """Drop aiohttp's traceback for a malformed or oversized request, or a body that is
    not what its framing or Content-Encoding claims (aiohttp meets that again while it
    drains the body after the answer): the client got its 400 or 431, and a flood of
    them must not flood the log (no logging per request). Our own failures, which
    aiohttp reports the same way, still get through."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, (HttpProcessingError, web.RequestPayloadError))


log.http.addFilter(_NoClientFaults())


def watch_half_closed(transport: asyncio.Transport, waiting: Callable[[], bool]) -> None:
    """Keep asking a client that shut its sending side whether it still listens, while
    `waiting()` (its answer has not begun).

    Why: a half-close and a client that went away look the same (a FIN) until something
    is written to it, and an answer that takes a while (a generation not streamed) would
    run on for a client long gone. A `100 Continue`, which an HTTP/1.1 client must read
    and skip, goes out every `_PROBE_SECONDS`: a closed socket answers one with a reset,
    and writing the next fails, which closes the connection and cancels the request (the
    backend aborts) within twice that. An answer that starts sooner is sent alone.
    """
    loop = asyncio.get_running_loop()

    def probe() -> None:
        if not transport.is_closing() and waiting():
            transport.write(_STILL_THERE)
            loop.call_later(_PROBE_SECONDS, probe)

    loop.call_later(_PROBE_SECONDS, probe)


def server_limits(limits: LimitsConfig) -> dict[str, object]:
    """aiohttp server settings for the client-side limits.

    aiohttp closes a connection that sits `keepalive_timeout` seconds without a complete
    request, counted from the connection or the previous response, and a trickle of
    bytes does not extend it: so it is both the idle keep-alive timeout and the header
    read timeout that ends slowloris connections. An over-long request or header line,
    or too many headers, is a 431 before any handler runs. After a refusal that left the
    body unread (413, 408) aiohttp reads and drops what still comes for
    `lingering_time`, so the client sees the answer instead of a reset, then closes.
    """
    return {
        "logger": log.http,
        "keepalive_timeout": limits.header_timeout,
        "lingering_time": min(LINGER_SECONDS, limits.body_timeout),
        **parser_limits(limits),
    }


def parser_limits(limits: LimitsConfig) -> dict[str, int]:
    """The request parser's limits (aiohttp's server and the fast path share its parser)."""
    return {
        "max_line_size": limits.max_header_bytes,
        "max_field_size": limits.max_header_bytes,
        "max_headers": limits.max_headers,
    }


def connection_handler(server: web.Server, limits: LimitsConfig) -> Callable[[], IngressHandler]:
    """What makes aiohttp's handler for a connection the fast path hands over: the
    router's settings (as given to `server`'s runner) and errors."""
    loop = asyncio.get_running_loop()
    settings = server_limits(limits)
    return functools.partial(
        IngressHandler, server, loop=loop, limits=limits, access_log=None, **settings
    )


class IngressHandler(web.RequestHandler):
    """aiohttp's connection handler, answering what aiohttp's server refuses by itself
    (a head over the limits: 431; a malformed request: 400; a handler's crash: 500) as
    the router answers everything: an OpenAI-style JSON error with X-Request-Id, where
    aiohttp's own answer is text/plain and quotes the client's bytes back. A client
    that half-closes after its request still gets the answer (`eof_received`)."""

    __slots__ = ("_last_body", "_limits")

    def __init__(self, manager: web.Server, *, limits: LimitsConfig, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        #: the body of the last request whose head came: is it whole?
        self._last_body: StreamReader | None = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._messages:  # heads parsed just now, queued for `start`
            self._last_body = self._messages[-1][1]

    def eof_received(self) -> bool:
        """The client shut its sending side, which HTTP allows once a request is out:
        requests whose bytes all came are answered, then the connection closes (True
        keeps it open for writing), and `watch_half_closed` notices a client that in
        fact went away. Idle, with a body cut short, or once the answer has begun (a
        stream may pause for seconds while a client that left must not hold the
        backend), it closes now, as aiohttp's own does."""
        waiter = self._waiter
        idle = waiter is not None and not waiter.done()  # `start` waits for a request
        body, request = self._last_body, self._current_request
        begun = request is not None and request.writer.output_size > 0
        if idle or begun or body is None or not body.is_eof():
            return False
        self.close()  # no more requests: close once the answers are out
        watch_half_closed(self.transport, self._unanswered)
        return True

    def _unanswered(self) -> bool:
        """An HTTP/1.1 request runs and nothing of its answer was written yet."""
        request = self._current_request
        return (
            request is not None
            and request.version >= HttpVersion11
            and request.writer.output_size == 0
        )

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's: it logs, and raises if an answer already started
        super().handle_error(request, status, exc, message)
        err = _server_refusal(status, exc, self._limits)
        headers, body = err.http_answer({REQUEST_ID: request_id(request.headers)})
        response = _Refusal(status=err.status, body=body, headers=headers)
        response.force_close()
        return response


class _Refusal(web.Response):
    """An answer to a request aiohttp's server refused by itself. No app runs for such
    a request, so `no_server_header` never sees it: it drops the header itself."""

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self.headers.popall(SERVER, None)


async def no_server_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: drop the `Server: Python/… aiohttp/…` aiohttp adds to every
    answer (it names the versions to attack)."""
    response.headers.popall(SERVER, None)


class IngressSite(web.TCPSite):
    """aiohttp's TCP site with IngressHandler on every connection (the admin listener;
    the data listener's FastSite hands its connections to the same handler)."""

    def __init__(self, runner: web.AppRunner, limits: LimitsConfig, **kwargs: Any) -> None:
        super().__init__(runner, **kwargs)
        self._limits = limits

    async def start(self) -> None:
        self._runner._reg_site(self)
        self._server = await asyncio.get_running_loop().create_server(
            connection_handler(self._runner.server, self._limits),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )


def _server_refusal(status: int, exc: BaseException | None, limits: LimitsConfig) -> KvrouteError:
    """The error for what aiohttp's server refused; it never repeats the client's bytes."""
    if isinstance(exc, LineTooLong):
        return HeadersTooLarge(
            f"A request header or the request line is over {limits.max_header_bytes} bytes."
        )
    if isinstance(exc, HttpProcessingError):
        if exc.message == _TOO_MANY_HEADERS:
            return HeadersTooLarge(f"The request has more than {limits.max_headers} headers.")
        return BadRequest("The request is not valid HTTP.")
    return KvrouteError(INTERNAL if status == 500 else HTTPStatus(status).phrase, status=status)


@web.middleware
async def errors_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Turn aiohttp's own HTTP errors (unknown path, wrong method) into OpenAI-style
    ones, and give every answer an X-Request-Id (the proxied ones have theirs)."""
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = KvrouteError(exc.reason, status=exc.status).to_http()
    if not response.prepared:  # a stream that started already has its own
        response.headers.setdefault(REQUEST_ID, request_id(request.headers))
    return response
