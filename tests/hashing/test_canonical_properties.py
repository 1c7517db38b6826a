"""hashing.canonical fuzzed: the text parses back into the request, and cuts are prefixes.

`_parse` reads a chat text back into fields. Because it recovers `_normal(request)` from the
text alone, two requests with different normal forms can never share a text.
"""

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from hashing.canonical import Message, MessagePart, chat_text

ESC = "\x1b"
# Text with the escape character and the marker letters well represented.
_TEXT = st.text(alphabet=st.sampled_from([ESC, "M", "C", "X", ";", "\n", "a", "é"]), max_size=6)
_RAW = st.one_of(
    st.just(msgspec.Raw()),
    st.just(msgspec.Raw(b"null")),
    _TEXT.filter(lambda t: t != "null").map(lambda t: msgspec.Raw(t.encode())),
)
_PART = st.one_of(
    st.builds(MessagePart, type=st.just("text"), text=st.none() | _TEXT),
    st.builds(
        MessagePart,
        type=st.sampled_from(["image_url", "input_audio", "M"]),
        image_url=_RAW,
        input_audio=_RAW,
    ),
)
_MESSAGE = st.builds(
    Message,
    role=_TEXT,
    content=st.none() | _TEXT | st.lists(_PART, max_size=3),
    name=st.none() | _TEXT,
    tool_calls=_RAW,
    tool_call_id=st.none() | _TEXT,
)
_REQUEST = st.tuples(st.lists(_MESSAGE, max_size=3), st.none() | _RAW)
_SETTINGS = settings(max_examples=100, deadline=None, database=None)


def _raw_normal(raw: msgspec.Raw | None) -> str | None:
    return None if not raw or bytes(raw) == b"null" else bytes(raw).decode()


def _content_normal(content: str | list[MessagePart] | None) -> tuple | None:
    """Content as items: merged text runs (the vLLM "\\n" join) and non-text parts."""
    if content is None:
        return None
    if isinstance(content, str):
        return (content,) if content else ()
    items: list = []
    after_text = False
    for part in content:
        if part.type != "text":
            items.append((part.type, _raw_normal(part.image_url), _raw_normal(part.input_audio)))
            after_text = False
        elif after_text:
            items[-1] += "\n" + (part.text or "")
        else:
            items.append(part.text or "")
            after_text = True
    return tuple(item for item in items if item != "")


def _normal(messages: list[Message], tools: msgspec.Raw | None) -> tuple:
    return (
        _raw_normal(tools),
        tuple(
            (
                m.role,
                m.name,
                _content_normal(m.content),
                _raw_normal(m.tool_calls),
                m.tool_call_id,
            )
            for m in messages
        ),
    )


def _lex(text: str) -> list[tuple[str, str]]:
    """("", value) runs and (letter, "") markers."""
    tokens: list[tuple[str, str]] = []
    run: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != ESC:
            run.append(text[i])
            i += 1
        elif text[i + 1] == ESC:
            run.append(ESC)
            i += 2
        else:
            if run:
                tokens.append(("", "".join(run)))
                run = []
            tokens.append((text[i + 1], ""))
            i += 2
    if run:
        tokens.append(("", "".join(run)))
    return tokens


class _Reader:
    def __init__(self, text: str) -> None:
        self.tokens = _lex(text)
        self.at = 0

    def marker(self, letter: str) -> bool:
        if self.at < len(self.tokens) and self.tokens[self.at] == (letter, ""):
            self.at += 1
            return True
        return False

    def value(self) -> str:
        if self.at < len(self.tokens) and self.tokens[self.at][0] == "":
            self.at += 1
            return self.tokens[self.at - 1][1]
        return ""

    def optional(self, letter: str) -> str | None:
        return self.value() if self.marker(letter) else None


def _parse(text: str) -> tuple:
    reader = _Reader(text)
    tools = reader.optional("T")
    messages = []
    while reader.marker("M"):
        role = reader.value()
        name = reader.optional("N")
        content = _parse_content(reader) if reader.marker("C") else None
        messages.append((role, name, content, reader.optional("F"), reader.optional("I")))
    assert reader.at == len(reader.tokens)
    return tools, tuple(messages)


def _parse_content(reader: _Reader) -> tuple:
    items: list = []
    while True:
        if reader.marker("X"):
            kind = reader.value()
            image_url, input_audio = reader.optional("U"), reader.optional("A")
            assert reader.marker(";")
            items.append((kind, image_url, input_audio))
        elif text := reader.value():
            items.append(text)
        else:
            return tuple(items)


@_SETTINGS
@given(_REQUEST)
def test_text_parses_back_into_the_request(request):
    messages, tools = request
    assert _parse(chat_text(messages, tools, 0)) == _normal(messages, tools)


@_SETTINGS
@given(_REQUEST, st.integers(min_value=1, max_value=200))
def test_a_limited_text_is_a_prefix_of_the_full_text(request, limit):
    messages, tools = request
    assert chat_text(messages, tools, limit) == chat_text(messages, tools, 0)[:limit]


@_SETTINGS
@given(_REQUEST, _MESSAGE)
def test_appending_a_message_extends_the_text(request, extra):
    messages, tools = request
    shorter = chat_text(messages, tools, 0)
    longer = chat_text([*messages, extra], tools, 0)
    assert longer.startswith(shorter)
    assert longer != shorter
