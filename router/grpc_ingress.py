"""grpc.aio servicer: a protobuf request in, the OpenAI JSON body through dispatch, protobuf out.

Each RPC turns its request into the JSON body an HTTP client would have sent (`_body`:
a field's name is its JSON key, an unset field is absent; proto/kvroute/v1/kvroute.proto
documents the mapping), parses it with the same `request.parse` and builds the same
`Call` as the HTTP ingress, so admission, model check, fingerprint, pick, in-flight
accounting, timeouts and metrics happen once, in `Dispatcher.exchange`. Bearer tokens
(`authorization` metadata) are checked by the HTTP ingress's `Authenticator` first. A unary answer
is decoded into one message. A stream is split into SSE events as the backend's chunks
arrive (`SseEvents`); each event becomes one message written before the next chunk is
read, so nothing is buffered beyond a partial event.

Errors: every failure becomes a `KvrouteError` rendered by `to_grpc()` (errors.py): the
router's own, a backend's non-200 answer, an in-band `data: {"error": ...}` event, or an
answer that does not decode. gRPC sends its status in trailers, so an error after
messages were sent is still an ordinary status. The abort happens after the `exchange`
block is left, so a backend's answered error is accounted as that status, not as a
broken exchange. Cancellation: a client's cancel or deadline cancels the handler task;
handlers write with `context.write` (not by yielding), so the cancellation lands inside
`exchange`, which closes the upstream connection and vLLM aborts the generation.

Beside the service: grpc.health.v1 (SERVING iff at least one backend is usable; Check is
exact, Watch follows within `_HEALTH_POLL_SECONDS`) and server reflection.

Cost per request beyond HTTP's: one orjson encode of the body, and one orjson decode
plus one message build per answer or SSE event (HTTP passes those bytes through).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

import grpc
import orjson
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from multidict import CIMultiDict

from proto.kvroute.v1 import kvroute_pb2 as pb
from proto.kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from router import log
from router.auth import Authenticator
from router.backends import Fleet
from router.config import Config
from router.dispatch import Call, Dispatcher, new_request_id
from router.errors import BadRequest, KvrouteError, PayloadTooLarge, UpstreamError
from router.metrics import Metrics
from router.proxy import Upstream
from router.request import Kind, parse

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
BACKEND_KEY = "x-kvroute-backend"
REQUEST_ID_KEY = "x-request-id"
_HEALTH_POLL_SECONDS = 1.0
#: in-flight RPCs get this long to finish when the router stops
_STOP_GRACE_SECONDS = 5.0
_PATHS = {Kind.CHAT: "/v1/chat/completions", Kind.COMPLETION: "/v1/completions"}

Convert = Callable[[dict], object]


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
    ) -> None:
        """`shared_port`: one of several workers listening on the same port."""
        self._config = config
        self._shared_port = shared_port
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
        # so_reuseport only between the workers of one router (router/workers.py checks
        # the port is free first): a second router on the same port must fail
        options = [
            ("grpc.so_reuseport", 1 if self._shared_port else 0),
            ("grpc.max_receive_message_length", max_message),
        ]
        server = self._server = grpc.aio.server(options=options)
        inference = _Inference(config, self._dispatcher, self._auth, self._metrics)
        pb_grpc.add_InferenceServicer_to_server(inference, server)
        self._health = _Health(self._fleet)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        host, port = config.grpc.host or config.listen.host, config.grpc.port
        self.port = server.add_insecure_port(
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        )
        await server.start()
        log.server.info("kvroute gRPC ingress listening on %s:%d", host, self.port)
        self._follow = asyncio.create_task(self._health.follow(), name="kvroute-grpc-health")
        return self.port

    async def stop(self) -> None:
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._follow is not None:
            self._follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follow
        if self._server is not None:
            await self._server.stop(_STOP_GRACE_SECONDS)


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

    async def CreateChatCompletion(self, request, context):
        return await self._unary(Kind.CHAT, request, context, _chat_completion)

    async def StreamChatCompletion(self, request, context) -> None:
        await self._stream(Kind.CHAT, request, context, _chat_chunk)

    async def CreateCompletion(self, request, context):
        return await self._unary(Kind.COMPLETION, request, context, _completion)

    async def StreamCompletion(self, request, context) -> None:
        await self._stream(Kind.COMPLETION, request, context, _completion)

    async def _unary(self, kind: Kind, request, context, convert: Convert):
        trailers, call = await self._call(kind, request, context, stream=False)
        try:
            async with self._dispatch.exchange(call) as upstream:
                trailers.append((BACKEND_KEY, upstream.backend_name))
                body = await upstream.read()
                status = upstream.status
                reply = _decode(convert, body) if status == 200 else None
            if reply is None:
                raise KvrouteError.from_body(body, status)
        except KvrouteError as err:
            await context.abort(*err.to_grpc(trailers))
        context.set_trailing_metadata(trailers)
        return reply

    async def _stream(self, kind: Kind, request, context, convert: Convert) -> None:
        trailers, call = await self._call(kind, request, context, stream=True)
        try:
            async with self._dispatch.exchange(call) as upstream:
                trailers.append((BACKEND_KEY, upstream.backend_name))
                if upstream.status == 200 and upstream.streaming:
                    error = await _relay(upstream, context, convert)
                else:
                    error = _not_streamed(upstream.status, await upstream.read())
            if error is not None:
                raise error
        except KvrouteError as err:
            await context.abort(*err.to_grpc(trailers))
        context.set_trailing_metadata(trailers)

    async def _call(self, kind: Kind, request, context, stream: bool):
        """The trailers so far and the `Call`, or abort with the request's error."""
        started = asyncio.get_running_loop().time()
        request_id, authorization, claimed = self._metadata(context.invocation_metadata() or ())
        trailers: list[tuple[str, str]] = [(REQUEST_ID_KEY, request_id)]
        routing = request.routing
        try:
            tenant = self._tenant(authorization, claimed, routing)  # no work for strangers
            body = orjson.dumps(_body(request, stream))
            if len(body) > self._max_body:
                raise PayloadTooLarge(
                    f"Request body of {len(body)} bytes exceeds the limit of "
                    f"{self._max_body} bytes."
                )
            req = parse(kind, body)
        except KvrouteError as err:
            self._dispatch.rejected(err)
            await context.abort(*err.to_grpc(trailers))
        headers = self._headers(request_id, authorization, tenant, routing)
        return trailers, Call(kind, req, "POST", _PATHS[kind], body, headers, started, tenant)

    def _metadata(self, metadata) -> tuple[str, str | None, str | None]:
        """The request id (made up if absent), the authorization and the tenant metadata."""
        request_id = authorization = tenant = None
        for key, value in metadata:
            if key == REQUEST_ID_KEY:
                request_id = value
            elif key == "authorization":
                authorization = value
            elif key == self._tenant_key:
                tenant = value
        return request_id or new_request_id(), authorization, tenant

    def _tenant(
        self, authorization: str | None, claimed: str | None, routing: pb.RoutingHints
    ) -> str | None:
        """As over HTTP: the token's tenant when auth is on and it has one (a client cannot
        choose it), else `routing.tenant`, else the tenant metadata. Raises Unauthorized."""
        if routing.HasField("tenant"):
            claimed = routing.tenant
        if not self._auth.enabled:
            return claimed
        tenant = self._auth.authenticate(authorization)
        if tenant is None:
            return claimed
        self._metrics.tenant_requests.labels(tenant).inc()
        return tenant

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


async def _relay(upstream: Upstream, context, convert: Convert) -> KvrouteError | None:
    """Write one message per SSE event as chunks arrive; return an in-band error, if any.

    After `[DONE]` or an error event the rest is drained (vLLM ends the body right after),
    so the connection goes back to the pool instead of being closed.
    """
    events = SseEvents()
    over = False
    error = None
    async for chunk in upstream.chunks():
        for data in events.feed(chunk):
            if over:
                continue
            if data == b"[DONE]":
                over = True
                continue
            obj = _loads(data)
            if "error" in obj:
                over, error = True, KvrouteError.from_body(obj)
                continue
            await context.write(_build(convert, obj))
    return error


def _not_streamed(status: int, body: bytes) -> KvrouteError:
    if status != 200:
        return KvrouteError.from_body(body, status)
    return UpstreamError("The backend answered a streamed request without streaming.")


class SseEvents:
    """Split a server-sent-events byte stream into each event's data, across chunks.

    Per the SSE spec: lines end in LF or CRLF, a blank line ends an event, its `data:`
    lines are joined by LF; other fields and comments are ignored. Only the current
    partial line is kept between chunks.
    """

    __slots__ = ("_data", "_tail")

    def __init__(self) -> None:
        self._tail = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()
        events = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
        return events


# ------------------------------------------------------------------ request → JSON body


def _body(request, stream: bool) -> dict:
    """The OpenAI JSON body of a Chat/CompletionRequest: set fields by name, bar exceptions."""
    body: dict = {}
    for field, value in request.ListFields():
        put = _PUT.get(field.name)
        if put is None:
            body[field.name] = _plain(value)
        else:
            put(body, value, stream)
    body["stream"] = stream
    if request.extra_json:
        _merge_extra(body, request.extra_json)
    return body


def _put_messages(body: dict, messages, stream: bool) -> None:
    body["messages"] = [_message(i, m) for i, m in enumerate(messages)]


def _put_sampling(body: dict, sampling, stream: bool) -> None:
    body.update(_plain(sampling))


def _put_stream_options(body: dict, options, stream: bool) -> None:
    if stream:  # vLLM refuses stream_options on a request that does not stream
        body["stream_options"] = _plain(options)


def _put_text(body: dict, text: str, stream: bool) -> None:
    body["prompt"] = text


def _put_token_ids(body: dict, ids: pb.TokenIds, stream: bool) -> None:
    body["prompt"] = list(ids.ids)


def _skip(body: dict, value, stream: bool) -> None:
    pass


_PUT = {
    "messages": _put_messages,
    "sampling": _put_sampling,
    "stream_options": _put_stream_options,
    "text": _put_text,
    "token_ids": _put_token_ids,
    "routing": _skip,
    "extra_json": _skip,
}


def _message(index: int, message: pb.ChatMessage) -> dict:
    out = _plain(message)
    parts = out.pop("parts", None)
    if parts is not None:
        if "content" in out:
            raise BadRequest(
                f"messages[{index}] sets both content and parts; content is one or the other",
                param=f"messages[{index}]",
            )
        out["content"] = parts
    return out


def _plain(value):
    """A protobuf value as JSON-ready Python: set fields only, by their proto names."""
    if type(value) in _SCALARS:
        return value
    if isinstance(value, Message):
        return {field.name: _plain(v) for field, v in value.ListFields()}
    if isinstance(value, Mapping):  # a map field (string keys in this proto)
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value]  # a repeated field


_SCALARS = frozenset((str, int, float, bool))


def _merge_extra(body: dict, extra_json: str) -> None:
    try:
        extra = orjson.loads(extra_json)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"extra_json is not valid JSON: {exc}", param="extra_json") from None
    if not isinstance(extra, dict):
        raise BadRequest("extra_json must be a JSON object", param="extra_json")
    clash = body.keys() & extra.keys()
    if clash:
        raise BadRequest(
            f"extra_json sets {', '.join(sorted(clash))}, which the request already sets",
            param="extra_json",
        )
    body.update(extra)


# ------------------------------------------------------------------ JSON answer → messages


def _loads(data: bytes) -> dict:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise UpstreamError(f"The backend sent invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise UpstreamError("The backend sent JSON that is not an object.")
    return obj


def _build(convert: Convert, obj: dict):
    try:
        return convert(obj)
    except (TypeError, ValueError, AttributeError) as exc:
        raise UpstreamError(f"The backend sent an answer of unexpected shape: {exc}") from None


def _decode(convert: Convert, body: bytes):
    return _build(convert, _loads(body))


def _chat_completion(d: dict) -> pb.ChatCompletion:
    choices = _chat_choices(d, pb.ChatChoice, "message")
    return pb.ChatCompletion(**_head(d), choices=choices, usage=_usage(d.get("usage")))


def _chat_chunk(d: dict) -> pb.ChatCompletionChunk:
    choices = _chat_choices(d, pb.ChatChunkChoice, "delta")
    return pb.ChatCompletionChunk(**_head(d), choices=choices, usage=_usage(d.get("usage")))


def _chat_choices(d: dict, choice: type, field: str) -> list:
    """Choices of an answer (`message`) or of a stream chunk (`delta`)."""
    return [
        choice(
            index=c.get("index"),
            **{field: _message_out(c.get(field))},
            finish_reason=c.get("finish_reason"),
        )
        for c in d.get("choices") or ()
    ]


def _completion(d: dict) -> pb.Completion:
    choices = [
        pb.CompletionChoice(
            index=c.get("index"), text=c.get("text"), finish_reason=c.get("finish_reason")
        )
        for c in d.get("choices") or ()
    ]
    return pb.Completion(**_head(d), choices=choices, usage=_usage(d.get("usage")))


def _head(d: dict) -> dict:
    return {"id": d.get("id"), "model": d.get("model"), "created": d.get("created")}


def _message_out(m: dict | None) -> pb.ChatMessageOut | None:
    if not m:
        return None
    reasoning = m.get("reasoning_content")
    return pb.ChatMessageOut(
        role=m.get("role"),
        content=m.get("content"),
        reasoning_content=m.get("reasoning") if reasoning is None else reasoning,
        tool_calls=[_tool_call(t) for t in m.get("tool_calls") or ()],
    )


def _tool_call(t: dict) -> pb.ToolCall:
    f = t.get("function")
    function = pb.FunctionCall(name=f.get("name"), arguments=f.get("arguments")) if f else None
    return pb.ToolCall(index=t.get("index"), id=t.get("id"), type=t.get("type"), function=function)


def _usage(u: dict | None) -> pb.Usage | None:
    if not u:
        return None
    details = u.get("prompt_tokens_details") or {}
    return pb.Usage(
        prompt_tokens=u.get("prompt_tokens"),
        completion_tokens=u.get("completion_tokens"),
        total_tokens=u.get("total_tokens"),
        cached_tokens=details.get("cached_tokens"),
    )


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
