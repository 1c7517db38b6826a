"""Exact prompt token ids from a backend's own `POST /tokenize`, for KV-aware matching.

When the router has no local copy of the model's tokenizer, the backends have one:
vLLM's `/tokenize` takes the chat form (`messages`, `tools`, `add_generation_prompt`) or
the prompt form and answers `{"tokens": [...]}` with exactly the ids it would compute.
The request's own `messages`/`tools` JSON is forwarded as it came (decoded as raw, never
re-encoded). Answers are cached by the bytes of the tokenize request, so repeated
prompts cost nothing; a new prompt costs one round trip to the least loaded candidate
before routing. Any failure returns None: routing falls back to the local tokenizer and
`kvroute_telemetry_fallbacks_total{reason="tokenize_failed"}` counts it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import aiohttp
import msgspec
import orjson
import xxhash

from router.fleet.backends import Fleet
from router.metrics import Metrics
from router.request import Kind

_TIMEOUT_S = 2.0
_MAX_ENTRIES = 4096


class _ChatFields(msgspec.Struct):
    messages: msgspec.Raw = msgspec.Raw()
    tools: msgspec.Raw = msgspec.Raw()


_CHAT = msgspec.json.Decoder(_ChatFields)


def tokenize_body(kind: Kind, model: str, body: bytes, prompt: object) -> bytes | None:
    """The /tokenize request for a chat or text-completions request; None otherwise."""
    head = b'{"model":' + orjson.dumps(model)
    if kind is Kind.CHAT:
        fields = _CHAT.decode(body)
        tools = b',"tools":' + bytes(fields.tools) if fields.tools else b""
        return head + b',"messages":' + bytes(fields.messages) + tools + b"}"
    if isinstance(prompt, str):
        return head + b',"prompt":' + orjson.dumps(prompt) + b"}"
    return None  # token ids need no tokenizer; batches route on their first ids


class RemoteTokenizer:
    def __init__(self, fleet: Fleet, session: aiohttp.ClientSession, metrics: Metrics) -> None:
        self._fleet = fleet
        self._session = session
        self._metrics = metrics
        self._cache: OrderedDict[int, list[int]] = OrderedDict()

    async def ids(self, kind: Kind, model: str, body: bytes, prompt: object) -> list[int] | None:
        request = tokenize_body(kind, model, body, prompt)
        if request is None:
            return None
        key = xxhash.xxh3_64_intdigest(request)
        ids = self._cache.get(key)
        if ids is not None:
            self._cache.move_to_end(key)
            return ids
        ids = await self._ask(model, request)
        if ids is not None:
            self._cache[key] = ids
            while len(self._cache) > _MAX_ENTRIES:
                self._cache.popitem(last=False)
        return ids

    async def _ask(self, model: str, request: bytes) -> list[int] | None:
        candidates = self._fleet.view(model).candidates
        if not candidates:
            return None
        backend = min(candidates, key=lambda b: b.inflight)
        headers = {"Content-Type": "application/json"}
        try:
            async with asyncio.timeout(_TIMEOUT_S):
                ask = backend.ask(self._session, "POST", "/tokenize", data=request, headers=headers)
                async with ask as resp:
                    answer = await resp.read() if resp.status == 200 else None
            tokens = orjson.loads(answer)["tokens"] if answer is not None else None
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError, KeyError):
            tokens = None
        if not isinstance(tokens, list):
            self._metrics.telemetry_fallbacks.labels(backend.name, "tokenize_failed").inc()
            return None
        return tokens
