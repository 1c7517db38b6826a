"""The few body fields routing reads, decoded once with reused msgspec Decoders.

Everything else in the body is skipped by the decoder and forwarded as the original
bytes. A body that is not JSON, or whose routing fields have the wrong type, becomes a
400 naming the field.
"""

from __future__ import annotations

from enum import Enum

import msgspec

from hashing.canonical import Message
from router.errors import BadRequest

#: a text, texts, token ids or batches of ids (msgspec allows one list type per union)
Prompt = str | list[str | int | list[int]]


class _Common(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    cache_salt: str | None = None


class ChatRequest(_Common):
    messages: list[Message] = msgspec.field(default_factory=list)
    #: empty when absent (msgspec cannot decode into `Raw | None`, msgspec issue #659)
    tools: msgspec.Raw = msgspec.Raw()


class CompletionRequest(_Common):
    prompt: Prompt | None = None


class EmbeddingRequest(_Common):
    input: Prompt | None = None


class OtherRequest(_Common):
    pass


class Kind(Enum):
    """Which OpenAI endpoint family a path belongs to."""

    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"
    OTHER = "other"


_DECODERS = {
    Kind.CHAT: msgspec.json.Decoder(ChatRequest),
    Kind.COMPLETION: msgspec.json.Decoder(CompletionRequest),
    Kind.EMBEDDING: msgspec.json.Decoder(EmbeddingRequest),
    Kind.OTHER: msgspec.json.Decoder(OtherRequest),
}


_REQUIRED = {Kind.CHAT: "messages", Kind.COMPLETION: "prompt", Kind.EMBEDDING: "input"}


def parse(kind: Kind, body: bytes) -> _Common:
    """Decode the routing fields of `body`; raise BadRequest with the reason."""
    if not body and kind is Kind.OTHER:
        return OtherRequest()
    try:
        req = _DECODERS[kind].decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"Invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Request body is not valid JSON: {exc}") from None
    except RecursionError:  # skipped fields are still walked: deep nesting ends here
        raise BadRequest("Request body is nested too deeply.") from None
    field = _REQUIRED.get(kind)
    if field is not None and not getattr(req, field):
        raise BadRequest(f"Field required: `{field}`", param=field)
    return req
