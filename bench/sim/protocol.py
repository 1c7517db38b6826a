"""The OpenAI-compatible wire shapes vLLM uses: request bodies in, JSON and SSE out.

Bodies decode into small Structs (unknown fields are ignored, as vLLM ignores extras it
does not use here); a malformed body is a 400 in vLLM's error shape
`{"error": {"message", "type", "param", "code"}}`. Responses follow vLLM 0.33:
ids `chatcmpl-<id>` / `cmpl-<id>`, SSE chunks `data: <json>\\n\\n` ending with
`data: [DONE]\\n\\n`, an extra `choices: []` usage chunk with include_usage, and
`usage.prompt_tokens_details.cached_tokens` always present (as with
--enable-prompt-tokens-details). The two endpoints differ only through `ResponseFormat`.
`kv_transfer_params` is NixlConnector's P/D field: in a request, the direction of the
transfer; in a non-streamed response of a prefill for a remote decode, where to read it.
"""

import time
from http import HTTPStatus
from typing import Annotated, Any

import msgspec
import orjson
from msgspec import Meta

from bench.sim.request import FinishReason, SimRequest, output_text
from bench.sim.tokenizer import VOCAB_SIZE, render_chat, tokenize

DONE = b"data: [DONE]\n\n"
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

TokenId = Annotated[int, Meta(ge=0, lt=VOCAB_SIZE)]
# vLLM >=0.30 validate_cache_salt: non-empty, <=128 chars, no '@', '/', '\' or NUL.
CacheSalt = Annotated[str, Meta(min_length=1, max_length=128, pattern="^[^@/\\\\\x00]*$")]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class KVTransferParams(msgspec.Struct, kw_only=True):
    """A request's `kv_transfer_params`. The simulator reads no remote memory, so of the
    peer's coordinates only the engine id is required, as the one vLLM needs to look up."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("do_remote_decode and do_remote_prefill cannot both be true")
        if self.do_remote_prefill and self.remote_engine_id is None:
            raise ValueError("do_remote_prefill needs the remote_engine_id to read from")


class GenerateBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: CacheSalt | None = None
    request_id: str | None = None
    n: Annotated[int, Meta(ge=1, le=1, description="the simulator samples one choice")] = 1
    kv_transfer_params: KVTransferParams | None = None

    def __post_init__(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")

    def limit(self) -> int | None:
        return self.max_tokens


class ChatBody(GenerateBody, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt_token_ids(self) -> list[int]:
        return tokenize(
            render_chat(
                self.messages,
                add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
            )
        )


class CompletionBody(GenerateBody, kw_only=True):
    prompt: str | list[TokenId]

    def prompt_token_ids(self) -> list[int]:
        return tokenize(self.prompt) if isinstance(self.prompt, str) else self.prompt


class TokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")

    def text(self) -> str:
        if self.messages is None:
            return self.prompt or ""
        return render_chat(
            self.messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
        )


class LoadLoraBody(msgspec.Struct, kw_only=True):
    lora_name: str = ""  # missing names are refused with vLLM's message, not a schema error
    lora_path: str = ""


class UnloadLoraBody(msgspec.Struct, kw_only=True):
    lora_name: str = ""


def error_json(status: int, message: str, param: str | None = None) -> bytes:
    err_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")
    return orjson.dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    )


def usage(req: SimRequest) -> dict[str, Any]:
    return {
        "prompt_tokens": req.prompt_len,
        "total_tokens": req.prompt_len + req.num_output,
        "completion_tokens": req.num_output,
        "prompt_tokens_details": {"cached_tokens": max(req.num_cached_tokens, 0)},
    }


def model_card(
    name: str, root: str, parent: str | None, created: int, max_model_len: int
) -> dict[str, Any]:
    """A `GET /v1/models` card as vLLM writes it: the base model's, or a LoRA adapter's
    (`parent`: its base model)."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{name}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class ResponseFormat:
    """The chat flavour; `COMPLETION` overrides the few places where they differ."""

    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def first_choice(self) -> dict[str, Any] | None:
        """The choice of the opening chunk, sent before any token (chat: the role)."""
        return {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def chunk_choice(self, text: str, finish: FinishReason | None) -> dict[str, Any]:
        return {
            "index": 0,
            "delta": {"content": text},
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }

    def full_choice(self, text: str, finish: FinishReason | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, "tool_calls": []}
        return {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }


class _CompletionFormat(ResponseFormat):
    id_prefix = "cmpl-"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def first_choice(self) -> dict[str, Any] | None:
        return None

    def chunk_choice(self, text: str, finish: FinishReason | None) -> dict[str, Any]:
        return {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }

    def full_choice(self, text: str, finish: FinishReason | None) -> dict[str, Any]:
        return {**self.chunk_choice(text, finish), "prompt_logprobs": None}


CHAT = ResponseFormat()
COMPLETION = _CompletionFormat()


class Responder:
    """Builds the JSON of one request's response or chunks."""

    def __init__(self, fmt: ResponseFormat, req: SimRequest, model: str) -> None:
        self.fmt = fmt
        self.req = req
        self._head = {
            "id": fmt.id_prefix + req.request_id,
            "object": fmt.chunk_object,
            "created": int(time.time()),
            "model": model,
        }

    def chunk(self, choices: list[dict[str, Any]], with_usage: bool = False) -> bytes:
        body = {**self._head, "choices": choices}
        if with_usage:
            body["usage"] = usage(self.req)
        return sse(body)

    def token_chunk(self, start: int, end: int, with_usage: bool) -> bytes:
        finish = self.req.finish_reason if end == self.req.num_output else None
        return self.chunk([self.fmt.chunk_choice(output_text(start, end), finish)], with_usage)

    def full(self, kv_transfer_params: dict[str, Any] | None = None) -> bytes:
        text = output_text(0, self.req.num_output)
        body = {
            **self._head,
            "object": self.fmt.object_name,
            "choices": [self.fmt.full_choice(text, self.req.finish_reason)],
            "usage": usage(self.req),
            "kv_transfer_params": kv_transfer_params,
        }
        return orjson.dumps(body)
