"""The prompt described for the policy: the model check (404), the prompt's exact token
ids when the policy keys its blocks by them, then the fingerprint and block keys.

Apart from the pick (pick.py) so that the prompt is tokenized outside the workers' pick
lock.
"""

from __future__ import annotations

import asyncio
import random

from hashing.chat_tokens import PromptBlocks
from hashing.fingerprint import Fingerprinter
from policies import RouteRequest
from router.dispatch.call import Call
from router.errors import BadRequest, ModelNotFound
from router.fleet.backends import Fleet
from router.request import Kind
from router.telemetry.tokenize import RemoteTokenizer


class Describer:
    """What the fleet's current policy reads of a call (the policy changes on reload)."""

    __slots__ = ("_fleet", "_tokenizer")

    def __init__(self, fleet: Fleet, tokenizer: RemoteTokenizer) -> None:
        self._fleet = fleet
        self._tokenizer = tokenizer

    def exact_ids(self) -> PromptBlocks | None:
        """The policy's block keys when they are built from the prompt's exact token ids
        (a backend's /tokenize, or a tokenizer too slow for the event loop), else None."""
        block_keys = self._fleet.policy.block_keys
        if block_keys is not None and (block_keys.remote or block_keys.offload):
            return block_keys
        return None

    async def token_ids(self, call: Call, block_keys: PromptBlocks) -> list[int] | None:
        """Exact ids from a backend's /tokenize, or from the HF tokenizer in a worker
        thread (it can take milliseconds: never on the event loop)."""
        req = call.req
        prompt = _prompt(req)
        if block_keys.remote:
            return await self._tokenizer.ids(call.kind, req.model or "", call.body, prompt)
        messages = req.messages if call.kind is Kind.CHAT else None
        tools = req.tools if call.kind is Kind.CHAT else None
        try:
            return await asyncio.to_thread(block_keys.local_ids, messages, tools, prompt)
        except ValueError as exc:  # e.g. the chat template refuses the conversation
            raise BadRequest(f"Cannot tokenize the prompt: {exc}") from None

    def describe(self, call: Call) -> RouteRequest:
        """What the policy reads of `call`; raise the client-facing error for an unknown
        model or a prompt it cannot read."""
        fleet = self._fleet
        model = call.req.model or ""
        if not fleet.view(model).candidates and not fleet.known_model(model):  # O(fleet)
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        try:
            return _describe(fleet, call, model)
        except ValueError as exc:  # e.g. a prompt mixing texts and token ids
            raise BadRequest(f"Invalid prompt: {exc}", param="prompt") from None


def _describe(fleet: Fleet, call: Call, model: str) -> RouteRequest:
    """The RouteRequest with what the fleet's policy reads: a fingerprint and/or block
    keys, and with block keys the answer's expected length."""
    req = call.req
    fingerprinter, block_keys = fleet.policy.fingerprinter, fleet.policy.block_keys
    fp = 0
    if fingerprinter is not None:
        # routing isolation: the tenant header and vLLM's cache partition (cache_salt)
        fp = _apply(fingerprinter, call, model, _tenant(call.tenant, req.cache_salt))
        fp = random.getrandbits(64) if fp is None else fp  # e.g. /v1/responses: spread
    blocks, tokens = (), 0
    if block_keys is not None and call.token_ids is not None:
        blocks, tokens = block_keys.of_ids(model, req.cache_salt, call.token_ids)
    elif block_keys is not None:
        # block keys isolate exactly as vLLM does: by cache_salt alone
        blocks, tokens = _apply(block_keys, call, model, req.cache_salt) or ((), 0)
    output = 0 if block_keys is None else _output_tokens(req, fleet, model)
    return RouteRequest(model, fp, blocks, tokens, output, call.request_id)


def _output_tokens(req: object, fleet: Fleet, model: str) -> int:
    """The answer's expected length: its limit when it sets one, else the median of the
    model's answers so far (0: none yet)."""
    limit = getattr(req, "max_completion_tokens", None) or getattr(req, "max_tokens", None)
    return max(0, limit) if limit else fleet.answers.expected(model)


def _apply(describer: Fingerprinter | PromptBlocks, call: Call, model: str, tenant: str | None):
    """Run `describer` on the request's prompt; None when it has none (not generation)."""
    req = call.req
    if call.kind is Kind.CHAT:
        return describer.chat(model, tenant, req.messages, req.tools)
    prompt = _prompt(req)
    return None if prompt is None else describer.prompt(model, tenant, prompt)


def _prompt(req: object):
    """A completion's prompt or another endpoint's input; None when it has neither."""
    return getattr(req, "prompt", None) or getattr(req, "input", None)


def _tenant(header: str | None, cache_salt: str | None) -> str | None:
    """The isolation key: the tenant header and vLLM's cache_salt (its own cache partition)."""
    if cache_salt is None:
        return header
    return cache_salt if header is None else f"{header}\x1f{cache_salt}"
