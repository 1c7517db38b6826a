"""Pure parts of the gRPC ingress: request → OpenAI body, SSE splitting, answer → messages
(grpc_convert.py), and the error translation (errors.to_grpc). One named row per case."""

from __future__ import annotations

import grpc
import orjson
import pytest
from google.rpc import error_details_pb2, status_pb2

from proto.kvroute.v1 import kvroute_pb2 as pb
from router.errors import (
    BadRequest,
    KvrouteError,
    ModelNotFound,
    NoBackendAvailable,
    Overloaded,
    PayloadTooLarge,
    UpstreamConnectError,
    UpstreamTimeout,
    grpc_code,
)
from router.ingress.grpc_convert import SseEvents, body_of, chat_chunk, chat_completion, completion
from router.request import Kind, parse

USER = pb.ChatMessage(role="user", content="hi")
USER_JSON = {"role": "user", "content": "hi"}

# ------------------------------------------------------------------ request → JSON body


@pytest.mark.parametrize(
    ("request_", "stream", "body"),
    [
        pytest.param(
            pb.ChatCompletionRequest(model="m", messages=[USER]),
            False,
            {"model": "m", "messages": [USER_JSON], "stream": False},
            id="chat-minimal",
        ),
        pytest.param(
            pb.ChatCompletionRequest(messages=[USER]),
            True,
            {"messages": [USER_JSON], "stream": True},
            id="unset-model-is-absent",
        ),
        pytest.param(
            pb.ChatCompletionRequest(
                messages=[USER],
                sampling=pb.SamplingParams(
                    temperature=0.0, top_p=0.9, n=2, stop=["a", "b"], logit_bias={"7": -1.5}
                ),
                max_completion_tokens=9,
                logprobs=True,
                top_logprobs=2,
            ),
            False,
            {
                "messages": [USER_JSON],
                "temperature": 0.0,
                "top_p": 0.9,
                "n": 2,
                "stop": ["a", "b"],
                "logit_bias": {"7": -1.5},
                "max_completion_tokens": 9,
                "logprobs": True,
                "top_logprobs": 2,
                "stream": False,
            },
            id="sampling-flattened-zero-kept",
        ),
        pytest.param(
            pb.ChatCompletionRequest(
                messages=[USER], stream_options=pb.StreamOptions(include_usage=True)
            ),
            True,
            {"messages": [USER_JSON], "stream_options": {"include_usage": True}, "stream": True},
            id="stream-options-when-streaming",
        ),
        pytest.param(
            pb.ChatCompletionRequest(
                messages=[USER], stream_options=pb.StreamOptions(include_usage=True)
            ),
            False,
            {"messages": [USER_JSON], "stream": False},
            id="stream-options-dropped-when-unary",
        ),
        pytest.param(
            pb.ChatCompletionRequest(
                messages=[
                    pb.ChatMessage(
                        role="user",
                        parts=[
                            pb.ContentPart(type="text", text="look"),
                            pb.ContentPart(
                                type="image_url", image_url=pb.ImageUrl(url="http://x/i.png")
                            ),
                        ],
                    )
                ]
            ),
            False,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "look"},
                            {"type": "image_url", "image_url": {"url": "http://x/i.png"}},
                        ],
                    }
                ],
                "stream": False,
            },
            id="parts-become-content",
        ),
        pytest.param(
            pb.ChatCompletionRequest(
                messages=[
                    pb.ChatMessage(
                        role="assistant",
                        tool_calls=[
                            pb.ToolCall(
                                id="c1",
                                type="function",
                                function=pb.FunctionCall(name="f", arguments="{}"),
                            )
                        ],
                    ),
                    pb.ChatMessage(role="tool", content="42", tool_call_id="c1"),
                ]
            ),
            False,
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    },
                    {"role": "tool", "content": "42", "tool_call_id": "c1"},
                ],
                "stream": False,
            },
            id="tool-call-history",
        ),
        pytest.param(
            pb.ChatCompletionRequest(
                messages=[USER],
                cache_salt="s",
                routing=pb.RoutingHints(tenant="t", session_id="x"),
                extra_json='{"tools": [{"type": "function"}], "priority": 3}',
            ),
            False,
            {
                "messages": [USER_JSON],
                "cache_salt": "s",
                "stream": False,
                "tools": [{"type": "function"}],
                "priority": 3,
            },
            id="routing-hints-not-in-body-extra-merged",
        ),
        pytest.param(
            pb.CompletionRequest(model="m", text="once", echo=True, logprobs=1),
            False,
            {"model": "m", "prompt": "once", "echo": True, "logprobs": 1, "stream": False},
            id="completion-text",
        ),
        pytest.param(
            pb.CompletionRequest(token_ids=pb.TokenIds(ids=[0, 1, 70000])),
            True,
            {"prompt": [0, 1, 70000], "stream": True},
            id="completion-token-ids",
        ),
    ],
)
def test_body(request_, stream: bool, body: dict) -> None:
    assert body_of(request_, stream) == body


@pytest.mark.parametrize(
    ("request_", "text"),
    [
        pytest.param(
            pb.ChatCompletionRequest(messages=[USER], extra_json="[1]"),
            "must be a JSON object",
            id="extra-not-object",
        ),
        pytest.param(
            pb.ChatCompletionRequest(messages=[USER], extra_json="{"),
            "not valid JSON",
            id="extra-not-json",
        ),
        pytest.param(
            pb.ChatCompletionRequest(messages=[USER], extra_json='{"stream": true}'),
            "stream",
            id="extra-sets-stream",
        ),
        pytest.param(
            pb.ChatCompletionRequest(
                messages=[pb.ChatMessage(role="user", content="", parts=[pb.ContentPart()])]
            ),
            "both content and parts",
            id="content-and-parts",
        ),
    ],
)
def test_body_rejects(request_, text: str) -> None:
    with pytest.raises(BadRequest, match=text) as info:
        body_of(request_, False)
    assert info.value.status == 400


def test_token_ids_reach_routing_as_ids() -> None:
    """The body parses into the same routing fields as an HTTP client's (ids stay ints)."""
    request_ = pb.CompletionRequest(model="m", token_ids=pb.TokenIds(ids=[3, 1, 4]))
    parsed = parse(Kind.COMPLETION, orjson.dumps(body_of(request_, False)))
    assert parsed.prompt == [3, 1, 4] and parsed.model == "m"


# ------------------------------------------------------------------ SSE splitting

EVENTS = b'data: {"a":1}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize(
    ("chunks", "events"),
    [
        pytest.param([EVENTS], [b'{"a":1}', b"[DONE]"], id="one-chunk"),
        pytest.param([EVENTS[:9], EVENTS[9:]], [b'{"a":1}', b"[DONE]"], id="split-in-json"),
        pytest.param([EVENTS[:14], EVENTS[14:]], [b'{"a":1}', b"[DONE]"], id="split-in-blank"),
        pytest.param([bytes([b]) for b in EVENTS], [b'{"a":1}', b"[DONE]"], id="byte-by-byte"),
        pytest.param([b"data: x\r\n\r\ndata: y\r\n\r\n"], [b"x", b"y"], id="crlf"),
        pytest.param([b"data:x\ndata: y\n\n"], [b"x\ny"], id="multi-line-no-space"),
        pytest.param([b": keep-alive\n\nevent: e\nid: 1\ndata: z\n\n"], [b"z"], id="other-fields"),
        pytest.param([b"data: partial"], [], id="unfinished-event"),
    ],
)
def test_sse_events(chunks: list[bytes], events: list[bytes]) -> None:
    sse = SseEvents()
    assert [e for chunk in chunks for e in sse.feed(chunk)] == events


# ------------------------------------------------------------------ answers → messages

USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 2,
    "total_tokens": 42,
    "prompt_tokens_details": {"cached_tokens": 32},
}


def test_chat_completion_message() -> None:
    reply = chat_completion(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 5,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": None, "reasoning_content": "r"},
                    "finish_reason": "tool_calls",
                    "logprobs": None,
                }
            ],
            "usage": USAGE,
        }
    )
    choice = reply.choices[0]
    assert (reply.id, reply.model, reply.created) == ("x", "m", 5)
    assert not choice.message.HasField("content") and choice.message.reasoning_content == "r"
    assert choice.finish_reason == "tool_calls"
    assert reply.usage.cached_tokens == 32 and reply.usage.prompt_tokens == 40


def test_chat_chunk_tool_call_delta_and_missing_usage_details() -> None:
    chunk = chat_chunk(
        {
            "id": "x",
            "choices": [
                {
                    "index": 1,
                    "delta": {
                        "tool_calls": [{"index": 0, "function": {"arguments": '{"a'}}],
                        "reasoning": "newer vLLM name",
                    },
                    "finish_reason": None,
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
    )
    choice = chunk.choices[0]
    assert choice.index == 1 and not choice.HasField("finish_reason")
    call = choice.delta.tool_calls[0]
    assert call.index == 0 and call.function.arguments == '{"a' and not call.HasField("id")
    assert choice.delta.reasoning_content == "newer vLLM name"
    assert not chunk.usage.HasField("cached_tokens")


def test_completion_message() -> None:
    reply = completion({"choices": [{"index": 0, "text": "t", "finish_reason": "length"}]})
    assert reply.choices[0].text == "t" and reply.choices[0].finish_reason == "length"
    assert not reply.HasField("usage")


# ------------------------------------------------------------------ errors → gRPC status


@pytest.mark.parametrize(
    ("error", "code"),
    [
        pytest.param(BadRequest("x"), grpc.StatusCode.INVALID_ARGUMENT, id="400-bad-request"),
        pytest.param(
            KvrouteError("x", status=401), grpc.StatusCode.UNAUTHENTICATED, id="401-no-auth-yet"
        ),
        pytest.param(
            KvrouteError("x", status=403), grpc.StatusCode.PERMISSION_DENIED, id="403-forbidden"
        ),
        pytest.param(ModelNotFound("x"), grpc.StatusCode.NOT_FOUND, id="404-unknown-model"),
        pytest.param(PayloadTooLarge("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, id="413-too-large"),
        pytest.param(
            KvrouteError("x", status=422), grpc.StatusCode.INVALID_ARGUMENT, id="422-validation"
        ),
        pytest.param(
            KvrouteError("x", status=418), grpc.StatusCode.INVALID_ARGUMENT, id="other-4xx"
        ),
        pytest.param(
            Overloaded("x", drop_reason="tenant_cap"),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            id="429-admission",
        ),
        pytest.param(KvrouteError("x"), grpc.StatusCode.INTERNAL, id="500-internal"),
        pytest.param(UpstreamConnectError("x"), grpc.StatusCode.UNAVAILABLE, id="502-upstream"),
        pytest.param(NoBackendAvailable("x"), grpc.StatusCode.UNAVAILABLE, id="503-no-backend"),
        pytest.param(UpstreamTimeout("x"), grpc.StatusCode.DEADLINE_EXCEEDED, id="504-timeout"),
        pytest.param(KvrouteError("x", status=507), grpc.StatusCode.INTERNAL, id="other-5xx"),
    ],
)
def test_to_grpc_code(error: KvrouteError, code: grpc.StatusCode) -> None:
    assert error.to_grpc().code == code
    assert grpc_code(error.status) == code


def test_to_grpc_trailers_carry_retry_info_and_error_info() -> None:
    err = NoBackendAvailable("no backend", retry_after=2, param="model")
    code, details, trailers = err.to_grpc([("x-request-id", "r")])
    assert (code, details) == (grpc.StatusCode.UNAVAILABLE, "no backend")
    meta = dict(trailers)
    assert meta["x-request-id"] == "r" and meta["retry-after"] == "2"
    status = status_pb2.Status.FromString(meta["grpc-status-details-bin"])
    assert status.code == grpc.StatusCode.UNAVAILABLE.value[0] and status.message == "no backend"
    info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info) and status.details[1].Unpack(retry)
    assert info.reason == "ServiceUnavailableError" and info.domain == "kvroute"
    assert dict(info.metadata) == {"http_status": "503", "param": "model"}
    assert retry.retry_delay.seconds == 2


def test_to_grpc_without_retry_has_no_retry_after() -> None:
    _, _, trailers = BadRequest("bad").to_grpc()
    assert "retry-after" not in dict(trailers)


@pytest.mark.parametrize(
    ("body", "status", "expected"),
    [
        pytest.param(
            b'{"error": {"message": "too long", "type": "BadRequestError", "param": "messages",'
            b' "code": 400}}',
            400,
            (400, "too long", "messages"),
            id="openai-shape",
        ),
        pytest.param(
            b'{"object": "error", "message": "no such model", "code": 404}',
            404,
            (404, "no such model", None),
            id="vllm-flat-shape",
        ),
        pytest.param(b"<html>bad gateway</html>", 502, (502, "HTTP 502", None), id="not-json"),
        pytest.param(
            {"error": {"message": "oom", "code": 500}}, None, (500, "oom", None), id="sse-event"
        ),
        pytest.param(
            {"error": {"message": "x", "code": "context_length_exceeded"}},
            None,
            (500, "x", None),
            id="sse-event-string-code",
        ),
        pytest.param(
            {"error": {"message": "bad", "code": 400}}, None, (400, "bad", None), id="sse-400"
        ),
    ],
)
def test_from_body(body, status, expected) -> None:
    err = KvrouteError.from_body(body, status)
    assert err.status == expected[0] and expected[1] in err.message and err.param == expected[2]
