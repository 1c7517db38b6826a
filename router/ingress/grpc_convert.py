"""gRPC ⇄ OpenAI JSON: a protobuf request as the JSON body an HTTP client would send,
a backend's JSON answer (or each SSE event of a stream) as a protobuf message.

The request side follows proto/kvroute/v1/kvroute.proto: a field's name is its JSON key,
an unset field is absent, `extra_json` adds keys the proto does not name (never one it
sets). The answer side reads what vLLM writes, tolerates absent fields, and turns any
answer it cannot read into an UpstreamError (a 502), never a crash.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import orjson
from google.protobuf.message import DecodeError, Message

from proto.kvroute.v1 import kvroute_pb2 as pb
from router.errors import BadRequest, UpstreamError

Convert = Callable[[dict], object]


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


def parse(message_type: type[Message], raw: bytes) -> Message:
    """A request message from its wire bytes; BadRequest (INVALID_ARGUMENT) if they are
    not one: bad input is the client's error, answered without a traceback."""
    try:
        return message_type.FromString(raw)
    except DecodeError:
        raise BadRequest(f"The request is not a valid {message_type.DESCRIPTOR.name}.") from None


def body_of(request, stream: bool) -> dict:
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


def loads(data: bytes) -> dict:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise UpstreamError(f"The backend sent invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise UpstreamError("The backend sent JSON that is not an object.")
    return obj


def build(convert: Convert, obj: dict):
    try:
        return convert(obj)
    except (TypeError, ValueError, AttributeError) as exc:
        raise UpstreamError(f"The backend sent an answer of unexpected shape: {exc}") from None


def decode(convert: Convert, body: bytes):
    return build(convert, loads(body))


def chat_completion(d: dict) -> pb.ChatCompletion:
    choices = _chat_choices(d, pb.ChatChoice, "message")
    return pb.ChatCompletion(**_head(d), choices=choices, usage=_usage(d.get("usage")))


def chat_chunk(d: dict) -> pb.ChatCompletionChunk:
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


def completion(d: dict) -> pb.Completion:
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
