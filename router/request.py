"""The few body fields routing reads, decoded once with reused msgspec Decoders.

Everything else in the body is skipped by the decoder and forwarded as the original
bytes. A body that is not JSON, or whose routing fields have the wrong type, becomes a
400 naming the field (in the message and as `param`).
"""

from __future__ import annotations

import re
from enum import Enum

import msgspec

from hashing.canonical import Message
from router.errors import BadRequest

#: A body at least this long is decoded and then described in loop turns of their own
#: (a 100,000-token chat's decoding, keys and pick each take the loop ~0.2-0.5 ms): a
#: small request arriving behind it waits one step, not the whole of it.
LONG_BODY = 64 << 10

#: a text, texts, token ids or batches of ids (msgspec allows one list type per union)
Prompt = str | list[str | int | list[int]]


class _Common(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    cache_salt: str | None = None
    #: as sent, unparsed (empty when absent): read only to ask for a stream's usage
    stream_options: msgspec.Raw = msgspec.Raw()


class ChatRequest(_Common):
    #: UNSET when absent, so that an empty list is told apart (and null stays invalid)
    messages: list[Message] | msgspec.UnsetType = msgspec.UNSET
    #: empty when absent (msgspec cannot decode into `Raw | None`, msgspec issue #659)
    tools: msgspec.Raw = msgspec.Raw()
    #: the answer's length limit (the newer name first), which KV_AWARE expects it to reach
    max_completion_tokens: int | None = None
    max_tokens: int | None = None


class CompletionRequest(_Common):
    prompt: Prompt | None = None
    max_tokens: int | None = None


class EmbeddingRequest(_Common):
    input: Prompt | None = None


class OtherRequest(_Common):
    pass


#: the request of a refusal before its body was read or parsed: no routing fields
NO_FIELDS = OtherRequest()


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
#: where a msgspec ValidationError message says the bad value is: "... - at `$.messages`"
_AT = re.compile(r" - at `\$\.(.+)`$")


def parse(kind: Kind, body: bytes) -> _Common:
    """Decode the routing fields of `body`; raise BadRequest with the reason."""
    if not body and kind is Kind.OTHER:
        return OtherRequest()
    try:
        req = _DECODERS[kind].decode(body)
    except msgspec.ValidationError as exc:
        at = _AT.search(str(exc))
        param = at.group(1) if at else None  # e.g. "messages", "messages[0].role"
        raise BadRequest(f"Invalid request body: {exc}", param=param) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Request body is not valid JSON: {exc}") from None
    except RecursionError:  # skipped fields are still walked: deep nesting ends here
        raise BadRequest("Request body is nested too deeply.") from None
    field = _REQUIRED.get(kind)
    if field is not None:
        value = getattr(req, field)
        if value is None or value is msgspec.UNSET:
            raise BadRequest(f"Field required: `{field}`", param=field)
        if not value:  # [] or ""
            raise BadRequest(f"`{field}` must not be empty.", param=field)
    return req


_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ENCODE = msgspec.json.Encoder()


def asking_usage(req: object, body: bytes) -> bytes | None:
    """`body` asking for its stream's usage (`stream_options.include_usage`), the other
    stream options kept; None when it need not: not streamed, already asking, or with
    stream options that are not an object (the backend says what is wrong)."""
    if not getattr(req, "stream", False):
        return None
    raw = req.stream_options
    options = msgspec.json.decode(raw) if raw else {}
    if not isinstance(options, dict) or options.get("include_usage"):
        return None
    return with_fields(body, {"stream_options": {**options, "include_usage": True}})


def with_fields(body: bytes, values: dict[str, object], drop: tuple[str, ...] = ()) -> bytes:
    """`body` (a JSON object that `parse` accepted) with `values` set and `drop` left
    out: every other field's bytes are kept as they came, unparsed (a pool's
    `model_map`, the two legs of a disaggregated request)."""
    fields = _FIELDS.decode(body)
    for name in drop:
        fields.pop(name, None)
    for name, value in values.items():
        fields[name] = msgspec.Raw(_ENCODE.encode(value))
    return _ENCODE.encode(fields)
