"""aiohttp routes: read and parse the request, hand it to dispatch, write the answer.

Generation endpoints are routed by the policy; the rest of vLLM's OpenAI surface is
proxied to a backend the same way (model-aware, fingerprint-free). JSON answers are
relayed whole; SSE streams are relayed chunk by chunk as they arrive. Before the first
byte reaches the client a failure is an OpenAI-style JSON error; after it, an error
event and `[DONE]` end the stream.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from multidict import CIMultiDict

from router.backends import Fleet
from router.config import Config
from router.dispatch import Call, Dispatcher, new_request_id
from router.errors import KvrouteError, PayloadTooLarge
from router.metrics import CONTENT_TYPE, Metrics
from router.proxy import Upstream, forward_headers
from router.request import Kind, parse

BACKEND_HEADER = "x-kvroute-backend"
REQUEST_ID = "X-Request-Id"

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
    def __init__(self, config: Config, fleet: Fleet, dispatcher: Dispatcher, metrics: Metrics):
        self._fleet = fleet
        self._dispatch = dispatcher
        self._metrics = metrics
        self._max_body = config.limits.max_body_bytes
        self._tenant_header = config.tenant_header

    def routes(self) -> list[web.RouteDef]:
        routed = [
            web.post("/v1/chat/completions", self._handler(Kind.CHAT)),
            web.post("/v1/completions", self._handler(Kind.COMPLETION)),
            web.post("/v1/embeddings", self._handler(Kind.EMBEDDING)),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/ready", self.ready),
            web.get("/metrics", self.metrics),
        ]
        other = self._handler(Kind.OTHER)
        routed += [web.route("*", path, other) for path in _PROXIED]
        return routed

    def _handler(self, kind: Kind):
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._proxy(kind, request)

        return handle

    async def _proxy(self, kind: Kind, request: web.Request) -> web.StreamResponse:
        started = asyncio.get_running_loop().time()
        headers = forward_headers(request.headers)
        request_id = headers.get(REQUEST_ID) or new_request_id()
        headers[REQUEST_ID] = request_id
        reply = {REQUEST_ID: request_id}
        try:
            body = await self._read_body(request)
            call = Call(
                kind,
                parse(kind, body),
                request.method,
                request.raw_path,
                body,
                headers,
                started,
                request.headers.get(self._tenant_header) if self._tenant_header else None,
            )
        except KvrouteError as err:
            self._dispatch.rejected(err)
            return err.to_http(reply)
        response: web.StreamResponse | None = None
        try:
            async with self._dispatch.exchange(call) as upstream:
                reply[BACKEND_HEADER] = upstream.backend_name
                if not upstream.streaming:
                    body = await upstream.read()
                    return web.Response(
                        status=upstream.status, body=body, headers=_reply(upstream, reply)
                    )
                response = web.StreamResponse(
                    status=upstream.status, headers=_reply(upstream, reply)
                )
                await response.prepare(request)
                await _relay(upstream, response)
            return response
        except KvrouteError as err:
            if response is None:
                return err.to_http(reply)
            await _end_stream_with(response, err)
            return response

    async def _read_body(self, request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > self._max_body:
            raise PayloadTooLarge(
                f"Request body of {request.content_length} bytes exceeds the limit of "
                f"{self._max_body} bytes."
            )
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLarge(
                f"Request body exceeds the limit of {self._max_body} bytes."
            ) from None

    async def models(self, request: web.Request) -> web.Response:
        cards: dict[str, dict] = {}
        for backend in self._fleet.members:
            for card in backend.model_cards:
                cards.setdefault(str(card.get("id")), card)
            for model in backend.configured_models or ():
                cards.setdefault(model, _card(model))
        return web.json_response({"object": "list", "data": list(cards.values())})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        if self._fleet.any_usable():
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "no usable backend"}, status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def _relay(upstream: Upstream, response: web.StreamResponse) -> None:
    async for chunk in upstream.chunks():
        await response.write(chunk)
    await response.write_eof()


async def _end_stream_with(response: web.StreamResponse, err: KvrouteError) -> None:
    """A stream that already started ends with an error event and [DONE], never a hang."""
    try:
        await response.write(b"\n\n" + err.sse_event())
        await response.write_eof()
    except ConnectionError:
        pass  # the client is gone too; nothing left to tell


def _reply(upstream: Upstream, extra: dict[str, str]) -> CIMultiDict[str]:
    headers = forward_headers(upstream.headers)
    headers.update(extra)
    return headers


def _card(model: str) -> dict:
    return {"id": model, "object": "model", "created": int(time.time()), "owned_by": "kvroute"}


@web.middleware
async def errors_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Turn aiohttp's own HTTP errors (unknown path, wrong method) into OpenAI-style ones."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return KvrouteError(exc.reason, status=exc.status).to_http()
