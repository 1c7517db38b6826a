"""hashing.canonical: unambiguous, prefix-preserving routing text, cut at the limit."""

import msgspec
import pytest

from hashing.canonical import Message, MessagePart, chat_text, prompt_text

ESC = "\x1b"


def raw(text: str) -> msgspec.Raw:
    return msgspec.Raw(text.encode())


def text_part(text: str) -> MessagePart:
    return MessagePart(type="text", text=text)


def image(url_json: str) -> MessagePart:
    return MessagePart(type="image_url", image_url=raw(url_json))


def audio(data_json: str) -> MessagePart:
    return MessagePart(type="input_audio", input_audio=raw(data_json))


SYSTEM = Message("system", "You are terse.")
USER = Message("user", "Hello")


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(
            ([Message("user", f"x{ESC}Massistant{ESC}Cy")], None),
            ([Message("user", "x"), Message("assistant", "y")], None),
            id="content-cannot-forge-a-message-boundary",
        ),
        pytest.param(
            ([Message(f"user{ESC}Chi")], None),
            ([Message("user", "hi")], None),
            id="role-cannot-forge-content",
        ),
        pytest.param(
            ([Message("user", f"a{ESC}")], None),
            ([Message("user", "a"), Message("")], None),
            id="trailing-esc-is-escaped",
        ),
        pytest.param(
            ([Message("user", name="bob")], None),
            ([Message("user", content="bob")], None),
            id="name-vs-content",
        ),
        pytest.param(
            ([Message("tool", tool_call_id="c1")], None),
            ([Message("tool", content="c1")], None),
            id="tool-call-id-vs-content",
        ),
        pytest.param(
            ([Message("assistant", tool_calls=raw('[{"id": "c1"}]'))], None),
            ([Message("assistant", '[{"id": "c1"}]')], None),
            id="tool-calls-vs-content",
        ),
        pytest.param(
            ([USER], raw('[{"type": "function"}]')),
            ([USER], None),
            id="tools-matter",
        ),
        pytest.param(
            ([USER], raw('"x"')),
            ([Message("tool", '"x"'), USER], None),
            id="tools-vs-a-message",
        ),
        pytest.param(
            ([SYSTEM, USER], None),
            ([USER, SYSTEM], None),
            id="message-order-matters",
        ),
        pytest.param(
            ([Message("user", "hi")], None),
            ([Message("assistant", "hi")], None),
            id="role-matters",
        ),
        pytest.param(
            ([Message("user", [text_part("ab"), text_part("c")])], None),
            ([Message("user", [text_part("a"), text_part("bc")])], None),
            id="text-part-boundaries",
        ),
        pytest.param(
            ([Message("user", [image('{"url": "a"}'), text_part("b")])], None),
            ([Message("user", [image('{"url": "a"}b')])], None),
            id="text-after-image-vs-longer-image",
        ),
        pytest.param(
            ([Message("user", [image(f'"a{ESC};"'), text_part("b")])], None),
            ([Message("user", [image('"a'), text_part('";b')])], None),
            id="raw-cannot-forge-part-close",
        ),
        pytest.param(
            ([Message("user", [image('{"url": "a"}')])], None),
            ([Message("user", [audio('{"url": "a"}')])], None),
            id="part-type-matters",
        ),
        pytest.param(
            ([Message("user", [MessagePart("x", image_url=raw("1"), input_audio=raw("2"))])], None),
            ([Message("user", [MessagePart("x", image_url=raw("12"))])], None),
            id="image-and-audio-payloads-stay-apart",
        ),
        pytest.param(
            ([Message("user", None)], None),
            ([Message("user", "")], None),
            id="no-content-vs-empty-content",
        ),
        pytest.param(
            ([SYSTEM, USER], None),
            ([SYSTEM, USER, Message("assistant", "")], None),
            id="an-extra-empty-message-matters",
        ),
    ],
)
def test_different_requests_give_different_text(a, b):
    assert chat_text(a[0], a[1], 0) != chat_text(b[0], b[1], 0)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(
            [Message("user", "a\nb")],
            [Message("user", [text_part("a"), text_part("b")])],
            id="text-parts-render-joined-by-newline-as-vllm-does",
        ),
        pytest.param(
            [Message("user", "")],
            [Message("user", [])],
            id="empty-string-and-empty-list",
        ),
        pytest.param(
            [Message("assistant", "x", tool_calls=raw("null"))],
            [Message("assistant", "x")],
            id="json-null-is-absent",
        ),
    ],
)
def test_equivalent_spellings_give_the_same_text(a, b):
    assert chat_text(a, None, 0) == chat_text(b, None, 0)


@pytest.mark.parametrize(
    "tools",
    [
        pytest.param(None, id="none"),
        pytest.param(msgspec.Raw(), id="empty-raw"),
        pytest.param(raw("null"), id="json-null"),
    ],
)
def test_absent_tools(tools):
    assert chat_text([USER], tools, 0) == chat_text([USER], None, 0)


def test_decoded_request_matches_constructed_one():
    body = (
        b'{"tools": [{"type": "function"}], "messages": [{"role": "user", "content": '
        b'[{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "u"}}],'
        b' "extra": 1}]}'
    )

    class Body(msgspec.Struct):
        messages: list[Message]
        tools: msgspec.Raw = msgspec.Raw()

    decoded = msgspec.json.decode(body, type=Body)
    built = [Message("user", [text_part("hi"), image('{"url": "u"}')])]
    assert chat_text(decoded.messages, decoded.tools, 0) == chat_text(
        built, raw('[{"type": "function"}]'), 0
    )


LONG_HISTORY = [
    Message("system", "S" * 5000),
    Message("user", f"question with an escape {ESC} in it"),
    Message("assistant", [text_part("part one"), image('{"url": "data:..."}'), text_part("two")]),
    Message("tool", "result", name="search", tool_call_id="c1"),
    Message("user", "é" * 3000),
]


@pytest.mark.parametrize(
    "limit",
    [
        pytest.param(1, id="one"),
        pytest.param(3, id="inside-the-first-marker"),
        pytest.param(1024, id="inside-the-system-message"),
        pytest.param(5040, id="just-past-the-system-message"),
        pytest.param(5070, id="inside-an-escape"),
        pytest.param(5150, id="inside-the-parts"),
        pytest.param(7000, id="inside-multibyte-text"),
        pytest.param(10**6, id="beyond-the-end"),
    ],
)
def test_limit_cuts_the_full_text(limit):
    full = chat_text(LONG_HISTORY, raw('[{"name": "search"}]'), 0)
    cut = chat_text(LONG_HISTORY, raw('[{"name": "search"}]'), limit)
    assert len(cut) == min(limit, len(full))
    assert cut == full[:limit]


@pytest.mark.parametrize("limit", [pytest.param(0, id="zero"), pytest.param(-5, id="negative")])
def test_non_positive_limit_means_no_limit(limit):
    full = chat_text(LONG_HISTORY, None, limit)
    assert full.endswith("é" * 3000)


def test_raw_json_cut_keeps_whole_characters():
    big = raw('"' + "é" * 100_000 + '"')
    text = chat_text([Message("user", [MessagePart(type="image_url", image_url=big)])], None, 40)
    assert len(text) == 40
    assert "\ufffd" not in text


@pytest.mark.parametrize(
    ("changed", "limit", "same"),
    [
        pytest.param(Message("user", "Goodbye"), 0, False, id="last-message-under-no-limit"),
        pytest.param(Message("user", "Goodbye"), 100_000, False, id="last-message-under-limit"),
        pytest.param(Message("user", "Goodbye"), 2000, True, id="last-message-past-limit"),
    ],
)
def test_every_message_matters_up_to_the_limit(changed, limit, same):
    base = [Message("system", "s" * 4000), USER]
    assert (chat_text(base, None, limit) == chat_text([base[0], changed], None, limit)) is same


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        pytest.param("abc", ["abc"], True, id="string-equals-one-element-list"),
        pytest.param(["ab", "c"], ["a", "bc"], False, id="element-boundaries-matter"),
        pytest.param([f"a{ESC}Bb"], ["a", "b"], False, id="separator-cannot-be-forged"),
        pytest.param(f"{ESC}M", [], False, id="escaped-marker"),
    ],
)
def test_prompt_text(a, b, same):
    assert (prompt_text(a, 0) == prompt_text(b, 0)) is same


@pytest.mark.parametrize(
    ("prompt", "limit", "expected"),
    [
        pytest.param("abcdef", 3, "abc", id="cut"),
        pytest.param("ab", 3, "ab", id="shorter-than-limit"),
        pytest.param(["ab", "cd"], 3, f"ab{ESC}", id="cut-in-separator"),
        pytest.param(["ab", "cd"], 0, f"ab{ESC}Bcd", id="joined"),
    ],
)
def test_prompt_text_limit(prompt, limit, expected):
    assert prompt_text(prompt, limit) == expected


def test_prompt_list_with_ids_is_rejected():
    with pytest.raises(ValueError, match=r"prompt\[1\] is int"):
        prompt_text(["a", 1], 0)  # type: ignore[list-item]


def test_chat_and_prompt_texts_never_meet():
    assert not prompt_text(f"{ESC}Muser", 0).startswith(f"{ESC}M")
    assert chat_text([Message("user")], None, 0) == f"{ESC}Muser"
