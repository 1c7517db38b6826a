"""grpc.aio servicer: a protobuf request in, the OpenAI JSON body through dispatch, protobuf out.

Each RPC turns its request into the JSON body an HTTP client would have sent
(grpc_convert.py: a field's name is its JSON key, an unset field is absent;
proto/kvroute/v1/kvroute.proto documents the mapping), parses it with the same
`request.parse` and builds the same `Call` as the HTTP ingress, so admission, model
check, fingerprint, pick, in-flight accounting, timeouts and metrics happen once, in
`Dispatcher.exchange`. Bearer tokens (`authorization` metadata) are checked by the HTTP
ingress's `Authenticator` first. A unary answer is decoded into one message. A stream is
split into SSE events as the backend's chunks arrive (`SseEvents`); each event becomes
one message written before the next chunk is read, so nothing is buffered beyond a
partial event.

Errors: every failure becomes a `KvrouteError` rendered by `to_grpc()` (errors.py): the
router's own, a backend's non-200 answer, an in-band `data: {"error": ...}` event, or an
answer that does not decode. gRPC sends its status in trailers, so an error after
messages were sent is still an ordinary status. The abort happens after the `exchange`
block is left, so a backend's answered error is accounted as that status, not as a
broken exchange. Cancellation: a client's cancel or deadline cancels the handler task;
handlers write with `context.write` (not by yielding), so the cancellation lands inside
`exchange`, which closes the upstream connection and vLLM aborts the generation.

Beside the service: grpc.health.v1 (SERVING iff at least one backend is usable; Check is
exact, Watch follows within `_HEALTH_POLL_SECONDS`) and server reflection, v1 and v1alpha
(grpc_reflection.py). With auth on, reflection (and any service but health and
Inference) needs a data-plane token too (grpc_gate.py): only the probe answers a
stranger. A message that does not parse is INVALID_ARGUMENT, after the token check,
with nothing logged.

Cost per request beyond HTTP's: one orjson encode of the body, and one orjson decode
plus one message build per answer or SSE event (HTTP passes those bytes through).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import orjson
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from multidict import CIMultiDict

from proto.kvroute.v1 import kvroute_pb2 as pb
from proto.kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from router import log
from router.config import Config, TokenClass
from router.dispatch.dispatcher import Call, Dispatcher, passable_request_id
from router.errors import KvrouteError, PayloadTooLarge, UpstreamError
from router.fleet.backends import Fleet
from router.ingress import grpc_convert, grpc_reflection
from router.ingress.auth import Authenticator
from router.ingress.grpc_gate import BytesIn, TokenGate
from router.metrics import Metrics
from router.request import NO_FIELDS, Kind, parse
from router.upstream.proxy import Upstream

#: every service the server registers and reflection lists (the route walk test calls
#: each of their methods)
SERVICES = (
    pb.DESCRIPTOR.services_by_name["Inference"],
    health_pb2.DESCRIPTOR.services_by_name["Health"],
    grpc_reflection.V1,
    grpc_reflection.V1ALPHA,
)
SERVICE = SERVICES[0].full_name
#: services the token gate lets through: Inference's handlers check the token themselves
#: (it gives the tenant), and health is a probe, as HTTP's /health
_UNGATED = frozenset({SERVICE, health.SERVICE_NAME})
BACKEND_KEY = "x-kvroute-backend"
POOL_KEY = "x-kvroute-pool"
#: why the backend was picked, when `flow.reason_header` is on (HTTP's x-kvroute-reason)
REASON_KEY = "x-kvroute-reason"
REQUEST_ID_KEY = "x-request-id"
#: W3C Trace Context metadata, passed to the backend as the HTTP headers it is
_TRACE_CONTEXT = frozenset({"traceparent", "tracestate"})
_HEALTH_POLL_SECONDS = 1.0
_PATHS = {Kind.CHAT: "/v1/chat/completions", Kind.COMPLETION: "/v1/completions"}
_REQUESTS = {Kind.CHAT: pb.ChatCompletionRequest, Kind.COMPLETION: pb.CompletionRequest}


class GrpcIngress:
    """The gRPC server: the Inference service, health and reflection, on its own port."""

    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        dispatcher: Dispatcher,
        metrics: Metrics,
        auth: Authenticator | None = None,
        shared_port: bool = False,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        """`shared_port`: one of several workers listening on the same port;
        `credentials`: TLS (router/control/tls.py), else plaintext."""
        self._config = config
        self._shared_port = shared_port
        self._credentials = credentials
        self._fleet = fleet
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._auth = auth or Authenticator(config.auth)  # the HTTP ingress's, from app.py
        self._server: grpc.aio.Server | None = None
        self._health: _Health | None = None
        self._follow: asyncio.Task | None = None
        self.port = 0

    async def start(self) -> int:
        """Bind and serve (on the running loop); return the bound port."""
        config = self._config
        max_message = config.limits.max_body_bytes
        # so_reuseport only between the workers of one router (router/control/supervisor.py checks
        # the port is free first): a second router on the same port must fail
        options = [
            ("grpc.so_reuseport", 1 if self._shared_port else 0),
            ("grpc.max_receive_message_length", max_message),
        ]
        server = self._server = grpc.aio.server(
            interceptors=[TokenGate(self._auth, _UNGATED)], options=options
        )
        inference = _Inference(config, self._dispatcher, self._auth, self._metrics)
        pb_grpc.add_InferenceServicer_to_server(inference, BytesIn(server))
        self._health = _Health(self._fleet)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        grpc_reflection.enable([s.full_name for s in SERVICES], server)
        host, port = config.grpc.host or config.listen.host, config.grpc.port
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self._credentials is None:
            self.port = server.add_insecure_port(address)
        else:
            self.port = server.add_secure_port(address, self._credentials)
        await server.start()
        tls = "" if self._credentials is None else " (TLS)"
        log.server.info("kvroute gRPC ingress listening on %s:%d%s", host, self.port, tls)
        self._follow = asyncio.create_task(self._health.follow(), name="kvroute-grpc-health")
        return self.port

    async def stop(self, grace: float) -> None:
        """Take no new RPCs; the ones in flight get `grace` seconds, then are cancelled
        (the router's drain has ended each one with a status before that)."""
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._follow is not None:
            self._follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follow
        if self._server is not None:
            await self._server.stop(grace)


class _Inference(pb_grpc.InferenceServicer):
    def __init__(
        self, config: Config, dispatcher: Dispatcher, auth: Authenticator, metrics: Metrics
    ) -> None:
        self._dispatch = dispatcher
        self._auth = auth
        self._metrics = metrics
        self._max_body = config.limits.max_body_bytes
        tenant_header = config.tenant_header
        self._tenant_key = tenant_header.lower() if tenant_header else None
        self._tenant_header = tenant_header

    # each takes its request as bytes (grpc_gate.BytesIn), parsed after the token check

    async def CreateChatCompletion(self, raw: bytes, context):
        return await self._unary(Kind.CHAT, raw, context, grpc_convert.chat_completion)

    async def StreamChatCompletion(self, raw: bytes, context) -> None:
        await self._stream(Kind.CHAT, raw, context, grpc_convert.chat_chunk)

    async def CreateCompletion(self, raw: bytes, context):
        return await self._unary(Kind.COMPLETION, raw, context, grpc_convert.completion)

    async def StreamCompletion(self, raw: bytes, context) -> None:
        await self._stream(Kind.COMPLETION, raw, context, grpc_convert.completion)

    async def _unary(self, kind: Kind, raw: bytes, context, convert: grpc_convert.Convert):
        trailers, call = await self._call(kind, raw, context, stream=False)
        try:
            async with self._dispatch.exchange(call) as upstream:
                trailers.extend(_served_by(upstream, call))
                body = await upstream.read()
                status = upstream.status
                reply = grpc_convert.decode(convert, body) if status == 200 else None
            if reply is None:
                raise KvrouteError.from_body(body, status)
        except KvrouteError as err:
            await context.abort(*err.to_grpc(_blaming(trailers, err)))
        context.set_trailing_metadata(trailers)
        return reply

    async def _stream(self, kind: Kind, raw: bytes, context, convert: grpc_convert.Convert) -> None:
        trailers, call = await self._call(kind, raw, context, stream=True)
        try:
            async with self._dispatch.exchange(call) as upstream:
                trailers.extend(_served_by(upstream, call))
                if upstream.status == 200 and upstream.streaming:
                    error = await _relay(upstream, context, convert, call.strip_usage)
                else:
                    error = _not_streamed(upstream.status, await upstream.read())
            if error is not None:
                raise error
        except KvrouteError as err:
            await context.abort(*err.to_grpc(_blaming(trailers, err)))
        context.set_trailing_metadata(trailers)

    async def _call(self, kind: Kind, raw: bytes, context, stream: bool):
        """The trailers so far and the `Call`, or abort with the request's error."""
        started, arrived = asyncio.get_running_loop().time(), time.perf_counter()
        metadata = context.invocation_metadata() or ()
        request_id, authorization, claimed = self._metadata(metadata)
        trailers: list[tuple[str, str]] = [(REQUEST_ID_KEY, request_id)]
        tenant = token_class = None
        try:
            tenant, token_class = self._token_tenant(
                authorization, claimed
            )  # no work for strangers
            request = grpc_convert.parse(_REQUESTS[kind], raw)
            routing = request.routing
            if not self._auth.enabled:
                tenant = self._claimed_tenant(claimed, routing)
            body = orjson.dumps(grpc_convert.body_of(request, stream))
            if len(body) > self._max_body:
                raise PayloadTooLarge(
                    f"Request body of {len(body)} bytes exceeds the limit of "
                    f"{self._max_body} bytes."
                )
            req = parse(kind, body)
        except KvrouteError as err:
            path, nothing = _PATHS[kind], CIMultiDict()
            unread = Call(kind, NO_FIELDS, "POST", path, b"", nothing, started, arrived, tenant)
            unread.request_id = request_id
            self._dispatch.rejected(err, unread)
            await context.abort(*err.to_grpc(trailers))
        headers = self._headers(request_id, authorization, tenant, routing)
        headers.extend((k, v) for k, v in metadata if k in _TRACE_CONTEXT)
        call = Call(kind, req, "POST", _PATHS[kind], body, headers, started, arrived, tenant)
        call.request_id, call.token_class = request_id, token_class
        call.sent_headers = CIMultiDict(metadata)  # what the capture records
        return trailers, call

    def _metadata(self, metadata) -> tuple[str, str | None, str | None]:
        """The request id (made up if absent or not a bounded token), the authorization
        and the tenant metadata."""
        request_id = authorization = tenant = None
        for key, value in metadata:
            if key == REQUEST_ID_KEY:
                request_id = value
            elif key == "authorization":
                authorization = value
            elif key == self._tenant_key:
                tenant = value
        return passable_request_id(request_id), authorization, tenant

    def _token_tenant(
        self, authorization: str | None, claimed: str | None
    ) -> tuple[str | None, TokenClass | None]:
        """With auth on, the tenant and token class as over HTTP (`Authenticator.identify`),
        the tenant metadata being the claimed tenant; None with auth off. Raises
        Unauthorized."""
        if not self._auth.enabled:
            return None, None
        tenant, token_class = self._auth.identify(authorization, claimed)
        if tenant is not None:
            self._metrics.tenant_request(tenant, self._auth.tenants)
        return tenant, token_class

    def _claimed_tenant(self, claimed: str | None, routing: pb.RoutingHints) -> str | None:
        """With auth off, the tenant metadata, or `routing.tenant` over it: only then,
        since a gateway can vouch for metadata it sets, not for a field of the message."""
        if routing.HasField("tenant"):
            claimed = routing.tenant
        return self._auth.tenant(None, claimed)

    def _headers(
        self,
        request_id: str,
        authorization: str | None,
        tenant: str | None,
        routing: pb.RoutingHints,
    ) -> CIMultiDict[str]:
        """Backend headers, as an HTTP client would have sent them."""
        headers = CIMultiDict({"Content-Type": "application/json", "X-Request-Id": request_id})
        if authorization is not None and not self._auth.enabled:  # the router's token stays
            headers["Authorization"] = authorization
        if tenant is not None and self._tenant_header:
            headers[self._tenant_header] = tenant
        if routing.HasField("session_id"):
            headers["X-Session-Id"] = routing.session_id
        return headers


async def _relay(
    upstream: Upstream, context, convert: grpc_convert.Convert, strip_usage: bool
) -> KvrouteError | None:
    """Write one message per SSE event as chunks arrive; return an in-band error, if any.
    `strip_usage`: the router asked for the usage event, which the client did not.

    After `[DONE]` or an error event the rest is drained (vLLM ends the body right after),
    so the connection goes back to the pool instead of being closed.
    """
    events = grpc_convert.SseEvents()
    over = False
    error = None
    async for chunk in upstream.chunks():
        for data in events.feed(chunk):
            if over:
                continue
            if data == b"[DONE]":
                over = True
                continue
            obj = grpc_convert.loads(data)
            if "error" in obj:
                over, error = True, KvrouteError.from_body(obj)
                continue
            if strip_usage and obj.get("usage") and obj.get("choices") == []:
                continue
            await context.write(grpc_convert.build(convert, obj))
    return error


def _served_by(upstream: Upstream, call: Call) -> list[tuple[str, str]]:
    """The trailers naming the backend that answered, its pool when it has one, and
    why it was picked when the reason is sent."""
    found = [(BACKEND_KEY, upstream.backend_name)]
    if upstream.pool is not None:
        found.append((POOL_KEY, upstream.pool))
    if call.decision:
        found.append((REASON_KEY, call.decision))
    return found


def _blaming(trailers: list[tuple[str, str]], err: KvrouteError) -> list[tuple[str, str]]:
    """The trailers, naming the backend an upstream failure blames when no answer from
    it named one (as the HTTP path's x-kvroute-backend on a 502 or 504)."""
    if not isinstance(err, UpstreamError) or err.backend is None:
        return trailers
    if any(key == BACKEND_KEY for key, _ in trailers):
        return trailers
    return [*trailers, (BACKEND_KEY, err.backend)]


def _not_streamed(status: int, body: bytes) -> KvrouteError:
    if status != 200:
        return KvrouteError.from_body(body, status)
    return UpstreamError("The backend answered a streamed request without streaming.")


# ------------------------------------------------------------------ health


class _Health(health.aio.HealthServicer):
    """grpc.health.v1 for "" and the Inference service: SERVING iff a backend is usable."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__()
        self._fleet = fleet
        self._status: int | None = None

    async def refresh(self) -> None:
        r = health_pb2.HealthCheckResponse
        status = r.SERVING if self._fleet.any_usable() else r.NOT_SERVING
        if status != self._status:
            self._status = status
            for service in ("", SERVICE):
                await self.set(service, status)

    async def Check(self, request, context):
        await self.refresh()  # exact, not as of the last poll
        return await super().Check(request, context)

    async def follow(self) -> None:
        """Keep Watch subscribers current: backend health changes outside this module."""
        while True:
            await self.refresh()
            await asyncio.sleep(_HEALTH_POLL_SECONDS)
