"""A backend answer's bytes through httptools (llhttp, through its public callback API):
its head, and the body when llhttp decodes it.

Within the limits and leniency of aiohttp's client, which parsed these answers before:
8190 bytes for the status line's reason and for a header's name and value together, 128
fields, no NUL in a value; lenient headers, LF without CR, spaces after a chunk size.
A chunked head is fed alone, so that its body can go to a `ChunkedBody` instead
(router/upstream/response.py); so is the head of an answer to HEAD, since llhttp does
not know it has no body. Any other answer (a JSON body with its length: most of them) is
fed whole, as it came.
"""

from __future__ import annotations

from typing import Protocol

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from router.upstream.failures import Malformed

MAX_LINE = 8190  # bytes of the status line's reason, and of a header's name and value
MAX_FIELDS = 128  # header fields in one head
#: a head is given up on past this (each of its lines is checked more closely)
_MAX_HEAD = MAX_LINE + MAX_FIELDS * (MAX_LINE + 4)
_INTERIM = range(100, 200)  # 1xx answers precede the final one (101 is final: an upgrade)


class Reading(Protocol):
    """The answer the parser reads for (router/upstream/response.py)."""

    should_close: bool

    def headed(self, status: int, headers: CIMultiDictProxy[str], alone: bool) -> None:
        """The final head is in; `alone`: it was fed without the bytes after it."""

    def piece(self, data: bytes) -> None:
        """A piece of the body, decoded by llhttp."""

    def ended(self) -> None:
        """llhttp saw the body's end."""

    def upgraded(self) -> None:
        """A 101's head: nothing after it is HTTP."""

    def malformed(self, why: str) -> None:
        """The bytes are not HTTP: nothing more on this connection is trusted."""


class AnswerParser:
    """Feeds one answer's bytes to httptools and tells the answer what they hold."""

    __slots__ = (
        "_alone",
        "_answer",
        "_carry",
        "_complete",
        "_fields",
        "_head_bytes",
        "_head_method",
        "_parser",
        "_short",
        "_status_bytes",
        "final",
    )

    def __init__(self, answer: Reading, head_method: bool) -> None:
        self._parser: httptools.HttpResponseParser | None = _lenient(self)
        self.restart(answer, head_method)

    def restart(self, answer: Reading, head_method: bool) -> None:
        """Read the next answer on the connection (llhttp is between two messages)."""
        self._answer = answer
        self._head_method = head_method  # the request was HEAD: no body follows
        self._complete = False  # llhttp saw the final answer end, and nothing after it
        self._fields: list[tuple[bytes, bytes]] = []
        self._carry = b""  # the last bytes of a head split across reads
        self._head_bytes = 0
        self._status_bytes = 0
        self._alone = False  # the head was fed without the bytes after it
        #: the head is known to hold no field over the limit, and no NUL
        self._short = False
        self.final = False  # the final head is in

    @property
    def reusable(self) -> bool:
        """llhttp is between two messages: the next answer can be parsed by it too."""
        return self._complete and self._parser is not None

    def drop(self) -> None:
        """Nothing more is parsed (the parser and these callbacks would otherwise form
        a cycle left for the GC)."""
        self._parser = None

    def take_head(self, data: bytes) -> bytes:
        """Parse the answer's head (and any interim heads before it) from `data`; return
        the bytes after the final head when it was fed alone (else they were fed too)."""
        while not self.final and self._parser is not None:
            end = _head_end(self._carry, data)
            if end < 0:  # all of it is head (or not HTTP: the parser says so)
                self._carry = (self._carry + data)[-3:]
                self._head_bytes += len(data)
                if self._head_bytes > _MAX_HEAD:
                    self.drop()
                    self._answer.malformed("the head is too long")
                else:
                    self.parse(data)
                return b""
            self._short = not self._carry and end <= MAX_LINE and data.find(b"\x00", 0, end) < 0
            self._carry, self._head_bytes = b"", 0
            self._alone = self._head_method or data.find(b"chunked", 0, end) >= 0
            if not self._alone:
                self.parse(data)
                return b""
            self.parse(data[:end])
            data = data[end:]
            if not data:
                break
        return data if self.final else b""

    def parse(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:  # dropped, or failed: nothing more on this connection is read
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.drop()
            self._answer.upgraded()
        except httptools.HttpParserError as exc:
            cause = exc.__context__ if isinstance(exc, httptools.HttpParserCallbackError) else exc
            self.drop()
            self._answer.malformed(f"invalid answer: {cause}")

    # httptools' callbacks
    def on_message_begin(self) -> None:
        if self.final:  # a second answer: nobody asked for it
            self._answer.should_close = True
            self._complete = False

    def on_status(self, status: bytes) -> None:
        self._status_bytes += len(status)
        if self._status_bytes > MAX_LINE:
            raise Malformed("the status line is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields.append((name, value))  # checked once the head is in, in one pass
        if len(self._fields) > MAX_FIELDS:
            raise Malformed("too many header fields")

    def on_headers_complete(self) -> None:
        parser, answer = self._parser, self._answer
        if not parser.should_keep_alive():
            answer.should_close = True
        status = parser.get_status_code()
        fields, self._fields, self._status_bytes = self._fields, [], 0
        if status in _INTERIM and status != 101:
            self._short = False  # what is known was of this head, not the next one
            return  # e.g. 100 Continue: the final answer follows
        if self.final:  # a second answer: nobody asked for it
            answer.should_close = True
            return
        self.final = True
        answer.headed(status, _headers(fields, self._short), self._alone)

    def on_body(self, data: bytes) -> None:
        self._answer.piece(data)

    def on_message_complete(self) -> None:
        if self.final:
            self._complete = True
            self._answer.ended()


def _headers(fields: list[tuple[bytes, bytes]], short: bool) -> CIMultiDictProxy[str]:
    """The head's fields, decoded as aiohttp decodes them; Malformed past its limits
    (`short`: the whole head is within them and holds no NUL, as most are)."""
    if not short:
        for name, value in fields:
            if len(name) + len(value) > MAX_LINE:  # as aiohttp counts a field
                raise Malformed("a header field is too long")
            if b"\x00" in value:
                raise Malformed("a NUL in a header value")
    return CIMultiDictProxy(CIMultiDict(decoded(fields)))


def decoded(fields: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """Names and values as str, UTF-8 with surrogate escapes (as aiohttp's parser gives
    them); strict UTF-8 first, the cheaper call for the ASCII of nearly every head."""
    try:
        return [(name.decode(), value.decode()) for name, value in fields]
    except UnicodeDecodeError:
        return [
            (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
            for name, value in fields
        ]


def _lenient(callbacks: AnswerParser) -> httptools.HttpResponseParser:
    """A parser as lenient as aiohttp's client's (its "lax" response parser)."""
    parser = httptools.HttpResponseParser(callbacks)
    parser.set_dangerous_leniencies(
        lenient_headers=True,
        lenient_optional_cr_before_lf=True,
        lenient_spaces_after_chunk_size=True,
    )
    return parser


def _head_end(carry: bytes, data: bytes) -> int:
    """Where in `data` the blank line ending a head ends, or -1; `carry` holds the last
    bytes (up to 3) of the head before `data`, for a blank line split between reads."""
    if carry:
        edge = (carry + data[:3]).find(b"\r\n\r\n")
        if edge >= 0:
            return edge + 4 - len(carry)
    end = data.find(b"\r\n\r\n")
    return end + 4 if end >= 0 else -1
