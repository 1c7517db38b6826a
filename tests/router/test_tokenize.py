"""The /tokenize request the router sends for KV-aware matching: forms and raw forwarding."""

from __future__ import annotations

import orjson
import pytest

from router.request import Kind
from router.telemetry.tokenize import tokenize_body

CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi \\u00e9"}],"tools":[{"x":1}]}'


@pytest.mark.parametrize(
    ("kind", "body", "prompt", "expected"),
    [
        pytest.param(
            Kind.CHAT,
            CHAT,
            None,
            {"model": "m", "messages": [{"role": "user", "content": "hi é"}], "tools": [{"x": 1}]},
            id="chat-with-tools",
        ),
        pytest.param(
            Kind.CHAT,
            b'{"messages":[{"role":"user","content":"a"}]}',
            None,
            {"model": "m", "messages": [{"role": "user", "content": "a"}]},
            id="chat-without-tools",
        ),
        pytest.param(Kind.COMPLETION, b"{}", "once", {"model": "m", "prompt": "once"}, id="text"),
        pytest.param(Kind.COMPLETION, b"{}", [1, 2], None, id="ids-need-nothing"),
        pytest.param(Kind.COMPLETION, b"{}", ["a", "b"], None, id="batch"),
    ],
)
def test_tokenize_body(kind: Kind, body: bytes, prompt, expected) -> None:
    out = tokenize_body(kind, "m", body, prompt)
    assert (orjson.loads(out) if out is not None else None) == expected


def test_chat_messages_are_forwarded_byte_for_byte() -> None:
    assert b'"content":"hi \\u00e9"' in tokenize_body(Kind.CHAT, "m", CHAT, None)
