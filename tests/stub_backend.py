"""A minimal, scriptable vLLM-like backend for router tests (real aiohttp server).

It answers the OpenAI endpoints with vLLM's shapes and SSE framing, paces stream chunks
so tests can measure pass-through latency, and can be told to fail, hang or cut a stream
so every error path of the router can be exercised. It records what it received and how
many requests were aborted by a disconnect.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass, field

import orjson
from aiohttp import web


@dataclass
class Behaviour:
    chunks: int = 3
    pace: float = 0.0
    status: int = 200
    hang_before_headers: bool = False
    hang_after_chunks: int | None = None
    cut_after_chunks: int | None = None
    delay: float = 0.0
    health_status: int = 200
    health_delay: float = 0.0
    #: what /tokenize answers: vLLM has answered 500 to a malformed body
    tokenize_status: int = 200
    #: as vLLM's --api-key: /v1 routes answer 401 without `Authorization: Bearer <key>`
    api_key: str | None = None
    #: a request whose body holds these bytes is answered 500, as vLLM answers some
    #: bodies it cannot handle (the request's fault, not the backend's)
    poison: bytes | None = None
    #: generation requests wait until this is set (a test holds them mid-request)
    gate: asyncio.Event | None = None
    #: each stream chunk after the first waits for a release of this: a test lets the
    #: stream on one event at a time (the closing [DONE] is not held)
    chunk_gate: asyncio.Semaphore | None = None
    #: what GET /metrics answers (a vLLM page), None: 404
    metrics: str | None = None


@dataclass
class StubBackend:
    model: str = "stub-model"
    behaviour: Behaviour = field(default_factory=Behaviour)
    received: list[dict] = field(default_factory=list)
    headers: list = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)
    active: int = 0
    max_active: int = 0
    aborted: int = 0
    completed: int = 0
    chunk_sent_at: list[float] = field(default_factory=list)
    health_checks: int = 0
    #: POST /v1/load_lora_adapter received (answered 404: no runtime LoRA updating)
    lora_loads: int = 0
    port: int = 0
    host: str = "127.0.0.1"
    #: serve https with this context (its certificate), else http
    tls: ssl.SSLContext | None = None
    #: serve under this path (a backend behind a gateway), e.g. "/team/vllm"
    prefix: str = ""
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        scheme = "http" if self.tls is None else "https"
        return f"{scheme}://{self.host}:{self.port}{self.prefix}"

    async def start(self) -> StubBackend:
        app = web.Application(middlewares=[self._api_key, _bad_json_is_400])
        app.add_routes(
            [
                web.get("/v1/models", self._models),
                web.post("/v1/chat/completions", self._generate),
                web.post("/v1/completions", self._generate),
                web.post("/v1/embeddings", self._embeddings),
                web.post("/tokenize", self._tokenize),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.post("/v1/load_lora_adapter", self._load_lora_adapter),
            ]
        )
        if self.prefix:  # only under the prefix: a request outside it is a 404
            root = web.Application()
            root.add_subapp(self.prefix, app)
            app = root
        # stopping cancels what is still held after a second, not aiohttp's 60: a test
        # that fails while a gate holds its requests ends then, not at its timeout
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.host, self.port, reuse_address=True, ssl_context=self.tls
        )
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def kill(self) -> None:
        """Die abruptly: cut every connection mid-whatever, then close the port.

        `start()` again comes back on the same port, as a restarted server would.
        """
        if self._runner is not None and self._runner.server is not None:
            for conn in self._runner.server.connections:
                conn.force_close()
        await self.stop()

    @web.middleware
    async def _api_key(self, request: web.Request, handler) -> web.StreamResponse:
        key = self.behaviour.api_key
        guarded = key is not None and request.path.startswith("/v1")
        if guarded and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "vllm"}
        return web.json_response({"object": "list", "data": [card]})

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.behaviour.metrics is None:
            return _error(404, "no metrics")
        return web.Response(text=self.behaviour.metrics)

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        await asyncio.sleep(self.behaviour.health_delay)
        return web.Response(status=self.behaviour.health_status)

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        """What vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING answers: the route is not
        there (FastAPI's 404)."""
        self.lora_loads += 1
        return web.json_response({"detail": "Not Found"}, status=404)

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        if self.behaviour.tokenize_status != 200:
            return _error(self.behaviour.tokenize_status, "stub tokenize failure")
        tokens = list(range(len(str(body.get("prompt", ""))) // 4))
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def _embeddings(self, request: web.Request) -> web.Response:
        self.received.append(orjson.loads(await request.read()))
        data = [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}]
        return web.json_response({"object": "list", "data": data, "model": self.model})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw)
        self.received.append(body)
        self.raw.append(raw)
        self.headers.append(request.headers.copy())
        if body.get("model") not in (None, "", self.model):
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        b = self.behaviour
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if b.delay:
                await asyncio.sleep(b.delay)
            if b.gate is not None:
                await b.gate.wait()
            if b.hang_before_headers:
                await asyncio.sleep(3600)
            if b.status != 200:
                return _error(b.status, "stub failure")
            if b.poison is not None and b.poison in raw:
                return _error(500, "stub cannot handle this body")
            chat = request.path.endswith("chat/completions")
            if body.get("stream"):
                response = await self._stream(request, body, b, chat)
            else:
                response = web.json_response(_completion(self.model, chat, b.chunks))
            self.completed += 1
            return response
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.active -= 1

    async def _stream(
        self, request: web.Request, request_body: dict, b: Behaviour, chat: bool
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(b.chunks):
            if b.cut_after_chunks == i:
                request.transport.close()
                raise asyncio.CancelledError  # the connection is gone
            if b.hang_after_chunks == i:
                await asyncio.sleep(3600)
            if i and b.pace:
                await asyncio.sleep(b.pace)
            if i and b.chunk_gate is not None:
                await b.chunk_gate.acquire()
            self.chunk_sent_at.append(time.monotonic())
            await response.write(b"data: " + orjson.dumps(_chunk(self.model, chat, i)) + b"\n\n")
        if (request_body.get("stream_options") or {}).get("include_usage"):
            usage = _usage(b.chunks)
            event = {"id": "chatcmpl-1", "model": self.model, "choices": [], "usage": usage}
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@web.middleware
async def _bad_json_is_400(request: web.Request, handler) -> web.StreamResponse:
    """As vLLM does: a body that is not JSON is the client's error, not a crash."""
    try:
        return await handler(request)
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        return _error(400, "bad request body")


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "Error", "param": None, "code": status}}
    return web.json_response(body, status=status)


def _chunk(model: str, chat: bool, i: int) -> dict:
    if chat:
        choice = {"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
            "choices": [choice],
        }
    choice = {"index": 0, "text": f"tok{i} ", "finish_reason": None}
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": [choice],
    }


def _usage(completion: int) -> dict:
    return {"prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5 + completion}


def _completion(model: str, chat: bool, n: int) -> dict:
    text = "".join(f"tok{i} " for i in range(n))
    usage = _usage(n)
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
        }
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [choice],
            "usage": usage,
        }
    choice = {"index": 0, "text": text, "finish_reason": "stop"}
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


async def stubs_on(hosts: list[str]) -> list[StubBackend]:
    """One stub on each loopback address in `hosts`, all on the same port (as discovered
    backends of one Service are)."""
    first = await StubBackend(host=hosts[0]).start()
    rest = [await StubBackend(host=h, port=first.port).start() for h in hosts[1:]]
    return [first, *rest]
