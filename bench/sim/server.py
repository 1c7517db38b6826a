"""HTTP surface of one simulated vLLM server (aiohttp), faults included.

Routes (vLLM 0.33 shapes, docs/vllm-telemetry.md §5): POST /v1/chat/completions,
POST /v1/completions, POST /v1/embeddings (bench/sim/embedding.py), GET /v1/models,
GET /health, POST /tokenize, GET /metrics, GET /load, GET /version,
GET /kv_event_sources, POST /reset_prefix_cache; with
runtime_lora_updating, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (absent
otherwise, so 404, as in vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING); and the
simulator's admin routes GET|POST /sim/fault, POST /sim/restart, GET /sim/stats.

A generation request: fault gate -> decode body -> resolve model (base or LoRA name) ->
tokenize -> submit to the engine -> JSON or SSE out. The handler is cancelled when the
client disconnects (AppRunner handler_cancellation) and its `finally` aborts the engine
request, as vLLM aborts on disconnect. The fault in force when a request arrives governs
it (except `slow`, which acts on the engine at once). `X-Request-Id` names the request
and is echoed on every response. A `kv_transfer_params` direction the server's kv_role
does not serve is a 400; a request without one is served whatever the role, as vLLM does.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import orjson
from aiohttp import web

from bench.sim import embedding, reports
from bench.sim.engine import updates
from bench.sim.lora import LoraError
from bench.sim.metrics import CONTENT_TYPE
from bench.sim.params import Fault, KVRole
from bench.sim.protocol import (
    CHAT,
    COMPLETION,
    DONE,
    ChatBody,
    CompletionBody,
    GenerateBody,
    KVTransferParams,
    LoadLoraBody,
    Responder,
    ResponseFormat,
    TokenizeBody,
    UnloadLoraBody,
    error_json,
)
from bench.sim.request import SimRequest
from bench.sim.tokenizer import token_strs, tokenize

if TYPE_CHECKING:
    from bench.sim.backend import SimBackend

_B = TypeVar("_B", bound=msgspec.Struct)
_CHAT = msgspec.json.Decoder(ChatBody)
_COMPLETION = msgspec.json.Decoder(CompletionBody)
_TOKENIZE = msgspec.json.Decoder(TokenizeBody)
_FAULT = msgspec.json.Decoder(Fault)
_LOAD_LORA = msgspec.json.Decoder(LoadLoraBody)
_UNLOAD_LORA = msgspec.json.Decoder(UnloadLoraBody)
_EMBEDDING = msgspec.json.Decoder(embedding.EmbeddingBody)
_ROLE_NAMES = {"prefill": "kv_producer", "decode": "kv_consumer"}
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
VLLM_VERSION = "0.33.0"


class ApiError(Exception):
    """Answered as vLLM's error body with this status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class _Cut(Exception):
    """The connection must be cut without a proper ending (fault or simulated crash)."""


def make_app(backend: SimBackend) -> web.Application:
    gen, vllm, sim = _Generation(backend), _VllmRoutes(backend), _SimRoutes(backend)
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
    app.on_response_prepare.append(_echo_request_id)
    app.add_routes(
        [
            web.post("/v1/chat/completions", gen.chat),
            web.post("/v1/completions", gen.completions),
            web.post("/v1/embeddings", vllm.embeddings),
            web.get("/v1/models", vllm.models),
            web.get("/health", vllm.health),
            web.post("/tokenize", vllm.tokenize),
            web.get("/metrics", vllm.metrics),
            web.get("/load", vllm.load),
            web.get("/version", vllm.version),
            web.get("/kv_event_sources", vllm.kv_event_sources),
            web.post("/reset_prefix_cache", vllm.reset_prefix_cache),
            web.get("/sim/fault", sim.get_fault),
            web.post("/sim/fault", sim.set_fault),
            web.post("/sim/restart", sim.restart),
            web.get("/sim/stats", sim.stats),
        ]
    )
    if backend.params.runtime_lora_updating:
        app.add_routes(
            [
                web.post("/v1/load_lora_adapter", vllm.load_lora_adapter),
                web.post("/v1/unload_lora_adapter", vllm.unload_lora_adapter),
            ]
        )
    return app


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return _json_bytes(error_json(e.status, str(e), e.param), status=e.status)


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    rid = request.headers.get("X-Request-Id")
    if rid is not None and "X-Request-Id" not in response.headers:
        response.headers["X-Request-Id"] = rid


def _json(obj: Any) -> web.Response:
    return _json_bytes(orjson.dumps(obj))


def _json_bytes(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")


async def _decode(request: web.Request, decoder: msgspec.json.Decoder[_B]) -> _B:
    try:
        return decoder.decode(await request.read())
    except msgspec.ValidationError as e:
        raise ApiError(400, str(e)) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"JSON decode error: {e}") from None


def _cut(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


async def _fault_gate(
    request: web.Request, backend: SimBackend, fault: Fault
) -> web.Response | None:
    """The response a `fail` or `hang` fault imposes, or None to proceed."""
    if fault.mode == "fail":
        message = f"Simulated failure (fault injected, {fault.status})."
        return _json_bytes(error_json(fault.status, message), status=fault.status)
    if fault.mode == "hang":
        await backend.wait_dropped()  # or cancelled when the client gives up
        _cut(request)
        return web.Response()  # never delivered: the connection is gone
    return None


def _lora_id(backend: SimBackend, model: str | None) -> int | None:
    """`model`'s LoRA id on `backend` (None: the base model); vLLM's 404 for a name it
    does not serve."""
    try:
        return backend.lora_id(model)
    except ValueError:
        raise ApiError(404, f"The model `{model}` does not exist.", "model") from None


def _check_kv_role(role: KVRole, params: KVTransferParams | None) -> None:
    """A 400 for a transfer direction this server's kv_role does not take part in."""
    if params is None:
        return
    if params.do_remote_decode and role == "decode":
        wrong = "do_remote_decode (prefill for a remote decode)"
    elif params.do_remote_prefill and role == "prefill":
        wrong = "do_remote_prefill (decode from a remote prefill)"
    else:
        return
    raise ApiError(
        400,
        f"kv_transfer_params asks for {wrong}, but this server's kv_role is "
        f"{_ROLE_NAMES[role]} ({role}).",
        "kv_transfer_params",
    )


class _Generation:
    """POST /v1/chat/completions and /v1/completions: fault gate to engine to JSON or SSE."""

    def __init__(self, backend: SimBackend) -> None:
        self.b = backend

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, _CHAT, CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, _COMPLETION, COMPLETION)

    async def _generate(
        self,
        request: web.Request,
        decoder: msgspec.json.Decoder[ChatBody] | msgspec.json.Decoder[CompletionBody],
        fmt: ResponseFormat,
    ) -> web.StreamResponse:
        fault = self.b.fault
        if (imposed := await _fault_gate(request, self.b, fault)) is not None:
            return imposed
        body = await _decode(request, decoder)
        req = self._new_request(request, body, body.prompt_token_ids())
        self.b.engine.submit(req)
        self.b.inflight += 1
        responder = Responder(fmt, req, body.model or self.b.params.model)
        cut_after = fault.after_chunks if fault.mode == "close_midstream" else None
        try:
            if body.stream:
                return await self._stream(request, body, responder, cut_after)
            return await self._complete(request, responder, cut_after is not None)
        finally:
            self.b.inflight -= 1
            self.b.engine.abort(req)

    def _new_request(
        self, request: web.Request, body: GenerateBody, prompt: list[int]
    ) -> SimRequest:
        p = self.b.params
        lora_id = _lora_id(self.b, body.model)
        transfer = body.kv_transfer_params
        _check_kv_role(p.kv_role, transfer)
        if not prompt:
            raise ApiError(400, "The prompt is empty.", "prompt")
        room = p.max_model_len - len(prompt)
        limit = body.limit()
        if room < (limit or 1):
            raise ApiError(
                400,
                f"This model's maximum context length is {p.max_model_len} tokens. However, "
                f"you requested {len(prompt) + (limit or 0)} tokens ({len(prompt)} in the "
                f"prompt, {limit or 0} in the completion). Please reduce the length.",
            )
        rid = request.headers.get("X-Request-Id") or body.request_id or uuid.uuid4().hex
        return SimRequest(
            rid,
            prompt,
            max_tokens=limit or min(p.default_max_tokens, room),
            limit_reason="length" if limit else "stop",
            block_size=p.block_size,
            model=body.model or p.model,
            lora_id=lora_id,
            salt=body.cache_salt,
            arrival=asyncio.get_running_loop().time(),
            remote_decode=transfer is not None and transfer.do_remote_decode,
            remote_prefill=transfer is not None and transfer.do_remote_prefill,
        )

    async def _complete(
        self, request: web.Request, responder: Responder, cut: bool
    ) -> web.StreamResponse:
        async for _ in updates(responder.req):
            pass
        if cut or responder.req.dropped:
            _cut(request)
        resp = _json_bytes(responder.full(reports.kv_transfer_params(self.b, responder.req)))
        resp.headers["X-Request-Id"] = responder.req.request_id
        return resp

    async def _stream(
        self, request: web.Request, body: GenerateBody, responder: Responder, cut_after: int | None
    ) -> web.StreamResponse:
        req, opts = responder.req, body.stream_options
        continuous = opts is not None and opts.continuous_usage_stats
        resp = web.StreamResponse(headers={**_SSE_HEADERS, "X-Request-Id": req.request_id})
        await resp.prepare(request)
        out = _SSEWriter(resp, cut_after)
        opening = responder.fmt.first_choice()
        try:
            sent = 0
            async for n in updates(req):
                if opening is not None:  # as vLLM: with the first token, once prefilled
                    await out.send(responder.chunk([opening]))
                    opening = None
                await out.send(responder.token_chunk(sent, n, continuous))
                sent = n
            if req.dropped:
                raise _Cut
            if opts is not None and opts.include_usage:
                await out.send(responder.chunk([], with_usage=True))
            await out.send(DONE)
        except _Cut:
            _cut(request)
        except ConnectionResetError:
            pass  # the client left; `_generate` aborts the request
        return resp


class _VllmRoutes:
    """vLLM's other routes: embeddings, health, models, tokenize, metrics, load, cache
    reset, LoRA."""

    def __init__(self, backend: SimBackend) -> None:
        self.b = backend

    async def health(self, request: web.Request) -> web.Response:
        return await _fault_gate(request, self.b, self.b.fault) or web.Response()

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": reports.model_cards(self.b)})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _decode(request, _TOKENIZE)
        _lora_id(self.b, body.model)
        text = body.text()
        tokens = tokenize(text)
        return _json(
            {
                "count": len(tokens),
                "max_model_len": self.b.params.max_model_len,
                "tokens": tokens,
                "token_strs": token_strs(text) if body.return_token_strs else None,
            }
        )

    async def embeddings(self, request: web.Request) -> web.Response:
        """Answered at once, off the engine: the vectors cost no step (bench/sim/embedding.py)."""
        if (imposed := await _fault_gate(request, self.b, self.b.fault)) is not None:
            return imposed
        body = await _decode(request, _EMBEDDING)
        _lora_id(self.b, body.model)
        if body.dimensions is not None and body.dimensions > embedding.DIMENSIONS:
            message = f"`dimensions` is at most {embedding.DIMENSIONS} for this model."
            raise ApiError(400, message, "dimensions")
        try:
            prompts = embedding.inputs(body.input, self.b.params.max_model_len)
        except ValueError as e:
            raise ApiError(400, str(e), "input") from None
        return _json(embedding.answer(body, prompts, body.model or self.b.params.model))

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.b.engine.metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def load(self, request: web.Request) -> web.Response:
        return _json({"server_load": self.b.inflight})

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": VLLM_VERSION})

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        return _json(reports.kv_event_sources(self.b))

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not await self.b.engine.reset_prefix_cache():
            raise ApiError(503, "Failed to reset prefix cache: KV blocks are in use.")
        return web.Response()

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await _decode(request, _LOAD_LORA)
        try:
            await self.b.loras.load(body.lora_name, body.lora_path)
        except LoraError as e:
            raise ApiError(e.status, str(e), "lora_name") from None
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await _decode(request, _UNLOAD_LORA)
        try:
            self.b.loras.unload(body.lora_name)
        except LoraError as e:
            raise ApiError(e.status, str(e), "lora_name") from None
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


class _SimRoutes:
    """The simulator's own admin routes under /sim: faults, restarts, stats."""

    def __init__(self, backend: SimBackend) -> None:
        self.b = backend

    async def get_fault(self, request: web.Request) -> web.Response:
        return _json(msgspec.to_builtins(self.b.fault))

    async def set_fault(self, request: web.Request) -> web.Response:
        self.b.set_fault(await _decode(request, _FAULT))
        return _json(msgspec.to_builtins(self.b.fault))

    async def restart(self, request: web.Request) -> web.Response:
        self.b.restart()
        return web.Response()

    async def stats(self, request: web.Request) -> web.Response:
        return _json(reports.snapshot(self.b))


class _SSEWriter:
    """Writes SSE chunks; raises _Cut instead of writing once `cut_after` were sent."""

    def __init__(self, resp: web.StreamResponse, cut_after: int | None) -> None:
        self._resp = resp
        self._left = cut_after

    async def send(self, data: bytes) -> None:
        if self._left is not None:
            if self._left == 0:
                raise _Cut
            self._left -= 1
        await self._resp.write(data)
