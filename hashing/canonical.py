"""Routing text: the deterministic serialization of a request's prompt that gets fingerprinted.

Algorithm. The text is built left to right from typed fields, never from the raw JSON body
(whose key order and spacing differ between clients):

    chat:     [ESC "T" tools] then, per message,
              ESC "M" role [ESC "N" name] [ESC "C" content] [ESC "F" tool_calls]
              [ESC "I" tool_call_id]
    content:  a string as is; a list of parts in order, a text part's text joined to a
              preceding text part by "\\n", a non-text part as
              ESC "X" type [ESC "U" image_url] [ESC "A" input_audio] ESC ";"
    prompt:   the strings of a completions prompt joined by ESC "B"

ESC is U+001B. Every string taken from the request (role, name, text, raw JSON of tools,
tool calls and non-text parts) has each ESC doubled, so a structural marker (ESC followed by
anything but ESC) can never come from content: a message cannot forge a role boundary.

Invariants.
- Unambiguous: the text can be parsed back into its fields, so two requests give the same
  text only if they have the same fields. The one deliberate exception follows vLLM, which
  renders a list of text parts as the parts joined by "\\n": a string content and a list of
  text parts with the same "\\n"-joined text (the same prompt, hence the same KV cache) give
  the same text; so do "" and [] (empty content), and a JSON null and an absent field.
- Prefix-preserving: requests that share leading messages share the leading text, and
  ``chat_text(m, t, k)`` is the first ``k`` characters of ``chat_text(m, t, 0)``.
- A chat text always starts with ESC "T" or ESC "M" and a prompt text never starts with one
  of them, so a chat request and a completions request never share text (except both empty).

Cost. O(limit): fields are cut to the remaining budget before escaping, so a 100k-char
history costs only what its first ``limit`` characters need. Escaping is a C-level scan
(``"\\x1b" in s``) and, only when the rare ESC is present, one ``str.replace``.
"""

import sys
from collections.abc import Sequence

import msgspec

__all__ = ["Message", "MessagePart", "chat_text", "prompt_text"]

_ESC = "\x1b"
_ESC2 = _ESC * 2
_TOOLS = _ESC + "T"
_MESSAGE = _ESC + "M"
_NAME = _ESC + "N"
_CONTENT = _ESC + "C"
_TOOL_CALLS = _ESC + "F"
_TOOL_CALL_ID = _ESC + "I"
_PART_OPEN = _ESC + "X"
_IMAGE_URL = _ESC + "U"
_INPUT_AUDIO = _ESC + "A"
_PART_CLOSE = _ESC + ";"
_PROMPT_SEPARATOR = _ESC + "B"
_UTF8_MAX_BYTES = 4


class MessagePart(msgspec.Struct):
    """One element of a list content. An empty ``msgspec.Raw()`` means the field is absent.

    Raw fields default to an empty Raw rather than ``Raw | None``: msgspec cannot decode a
    non-null value into ``Raw | None`` (msgspec issue #659); its author recommends this form.
    """

    type: str = "text"
    text: str | None = None
    image_url: msgspec.Raw = msgspec.Raw()
    input_audio: msgspec.Raw = msgspec.Raw()


class Message(msgspec.Struct):
    """One chat message, with only the fields that shape the prompt (others are ignored)."""

    role: str = ""
    content: str | list[MessagePart] | None = None
    name: str | None = None
    tool_calls: msgspec.Raw = msgspec.Raw()
    tool_call_id: str | None = None


def chat_text(messages: Sequence[Message], tools: msgspec.Raw | None, limit: int) -> str:
    """The routing text of a chat request: its first ``limit`` characters (all if limit <= 0)."""
    text = _Text(limit)
    tools_json = _raw_json(tools)
    if tools_json is not None:
        text.marker(_TOOLS)
        text.raw(tools_json)
    for message in messages:
        if text.full:
            break
        _write_message(text, message)
    return text.result()


def prompt_text(prompt: str | list[str], limit: int) -> str:
    """The routing text of a completions prompt: its first ``limit`` characters (all if <= 0).

    Raises ValueError on a list element that is not a string (within the ``limit``).
    """
    text = _Text(limit)
    if isinstance(prompt, str):
        text.value(prompt)
        return text.result()
    for index, value in enumerate(prompt):
        if text.full:
            break
        if not isinstance(value, str):  # the request schema admits lists mixing texts and ids
            raise ValueError(f"prompt[{index}] is {type(value).__name__}, expected str")
        if index:
            text.marker(_PROMPT_SEPARATOR)
        text.value(value)
    return text.result()


class _Text:
    """The routing text under construction, cut at ``limit`` characters (none if <= 0).

    Values are cut to the characters still wanted before they are escaped or decoded, so a
    long field costs only what the text keeps of it.
    """

    __slots__ = ("_left", "_parts")

    def __init__(self, limit: int) -> None:
        self._parts: list[str] = []
        self._left = limit if limit > 0 else sys.maxsize

    @property
    def full(self) -> bool:
        return self._left <= 0

    def marker(self, marker: str) -> None:
        self._add(marker)

    def value(self, value: str) -> None:
        self._add(_escape(value[: self._left]))

    def raw(self, raw: memoryview) -> None:
        self._add(_escape(_decode(raw, self._left)))

    def result(self) -> str:
        return "".join(self._parts)

    def _add(self, text: str) -> None:
        if len(text) > self._left:
            text = text[: self._left]  # only the last piece is cut: the join copies once
        self._parts.append(text)
        self._left -= len(text)


def _escape(text: str) -> str:
    # Escaping maps each character to one or two, so escaping a cut value and cutting the
    # result gives the same leading characters as escaping the whole value.
    return text.replace(_ESC, _ESC2) if _ESC in text else text


def _decode(raw: memoryview, left: int) -> str:
    # The first n characters of UTF-8 lie in its first 4n bytes; a character split by the
    # cut lies past n, so its replacement character is cut off by the caller.
    return bytes(raw[: left * _UTF8_MAX_BYTES]).decode("utf-8", errors="replace")


def _raw_json(raw: msgspec.Raw | None) -> memoryview | None:
    """The JSON of a Raw field, or None when it is absent (None or empty Raw) or JSON null."""
    if not raw:
        return None
    view = memoryview(raw)
    return None if view == b"null" else view


def _write_message(text: _Text, message: Message) -> None:
    text.marker(_MESSAGE)
    text.value(message.role)
    if message.name is not None:
        text.marker(_NAME)
        text.value(message.name)
    if message.content is not None:
        text.marker(_CONTENT)
        _write_content(text, message.content)
    tool_calls = _raw_json(message.tool_calls)
    if tool_calls is not None:
        text.marker(_TOOL_CALLS)
        text.raw(tool_calls)
    if message.tool_call_id is not None:
        text.marker(_TOOL_CALL_ID)
        text.value(message.tool_call_id)


def _write_content(text: _Text, content: str | list[MessagePart]) -> None:
    if isinstance(content, str):
        text.value(content)
        return
    after_text = False
    for part in content:
        if part.type != "text":
            _write_non_text(text, part)
            after_text = False
            continue
        if after_text:
            text.value("\n")
        text.value(part.text or "")
        after_text = True


def _write_non_text(text: _Text, part: MessagePart) -> None:
    text.marker(_PART_OPEN)
    text.value(part.type)
    for marker, raw in ((_IMAGE_URL, part.image_url), (_INPUT_AUDIO, part.input_audio)):
        payload = _raw_json(raw)
        if payload is not None:
            text.marker(marker)
            text.raw(payload)
    text.marker(_PART_CLOSE)
