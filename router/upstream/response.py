"""One backend answer read off its connection: the head parsed by httptools (llhttp,
through its public callback API), the body decoded into a BodyReader.

A chunked body is decoded by `ChunkedBody` (router/upstream/chunked.py) instead of the
parser, so that a read of whole chunks can be passed on to a relay as the backend framed
it. For that its head is fed to the parser alone; any other answer (a JSON body with its
length: most of them) is fed whole, as it came. An answer to HEAD is fed alone too, since
llhttp does not know it has no body. The head's limits are aiohttp's client's: 8190
bytes per line and field, 128 fields.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple, Protocol

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from router.upstream.body import BodyReader, Pausable, empty_body
from router.upstream.chunked import ChunkedBody, ChunkError
from router.upstream.failures import (
    Closed,
    ContentLengthError,
    Cut,
    Malformed,
    Reset,
    TransferEncodingError,
)

MAX_LINE = 8190  # bytes of the status line's reason, and of a header's name and value
MAX_FIELDS = 128  # header fields in one head
#: a head is given up on past this (each of its lines is checked more closely)
_MAX_HEAD = MAX_LINE + MAX_FIELDS * (2 * MAX_LINE + 4)
_INTERIM = range(100, 200)  # 1xx answers precede the final one (101 is final: an upgrade)
_NO_BODY_STATUS = frozenset({204, 304})
#: what the body is read by once the final head is in
_PARSER, _CHUNKED, _NONE = range(3)


class Head(NamedTuple):
    """A final answer's status and headers."""

    status: int
    headers: CIMultiDictProxy[str]


class Host(Pausable, Protocol):
    """The connection an answer is read from (router/upstream/connection.py)."""

    def close(self) -> None: ...


class Relaying(Protocol):
    """A relay taking the body from the connection's callbacks (router/upstream/relay.py)."""

    def drain(self) -> None: ...

    def forward(self, chunks: bytes) -> bool: ...


class Answer:
    """Reads one answer: `head` resolves once the final head is in (1xx skipped), with
    the body's reader; `should_close` tells whether the connection can be reused."""

    __slots__ = (
        "_alone",
        "_body",
        "_carry",
        "_cut",
        "_fields",
        "_head_bytes",
        "_host",
        "_method",
        "_mode",
        "_parser",
        "_status_bytes",
        "_until_close",
        "chunked",
        "head",
        "should_close",
    )

    def __init__(self, host: Host, loop: asyncio.AbstractEventLoop, method: str) -> None:
        self._host = host
        self._method = method
        self._parser: httptools.HttpResponseParser | None = _parser(self)
        self._body = BodyReader(host, loop)
        self._fields: list[tuple[str, str]] = []
        self._carry = b""  # the last bytes of a head split across reads
        self._alone = False  # the head was fed to the parser without what follows it
        self._head_bytes = 0
        self._status_bytes = 0
        self._mode: int | None = None  # how the body is read, once the final head is in
        self._until_close = False  # the body ends where the connection does
        self._cut: type[Cut] = ContentLengthError  # what a body cut short fails with
        self.should_close = False
        #: the answer's chunked body, decoded here rather than by the parser
        self.chunked: ChunkedBody | None = None
        self.head: asyncio.Future[tuple[Head, BodyReader]] = loop.create_future()

    @property
    def body_done(self) -> bool:
        """The body ended cleanly (the connection may then be reused)."""
        body = self._body
        return self.head.done() and body.is_eof() and body.exception() is None

    def feed(self, data: bytes, relay: Relaying | None) -> None:
        """Bytes of the answer as they came; `relay`, if one takes the body, hears of
        them (and may pass whole chunks on as they are)."""
        if self.chunked is None:
            mode = self._mode
            if mode is None:
                data = self._take_head(data)  # what follows a chunked head, if anything
            elif mode is _PARSER:
                self._parse(data)
                data = b""
            elif data:  # bytes after a bodiless answer: the connection is not reused
                self.should_close = True
            if self.chunked is None:
                if relay is not None:
                    relay.drain()
                return
        if data:
            self.chunk_received(data, relay)

    def drop(self) -> None:
        """The exchange is over: the parser goes (it and this answer's callbacks would
        otherwise form a cycle left for the GC)."""
        self._parser = None

    def lost(self, exc: BaseException | None) -> None:
        """The connection ended: a body read until then ends, any other one was cut."""
        self.should_close = True
        self._parser = None
        body = self._body
        if self.head.done() and not body.is_eof():
            if self._until_close:
                body.feed_eof()
            else:
                self.fail(self._cut(f"the connection ended before the body did ({exc!r})"))
        elif exc is None:
            self.fail(Closed("the backend closed the connection"))
        else:
            self.fail(Reset(f"the connection failed: {exc!r}"))

    def fail(self, exc: Malformed | Closed | Reset | Cut) -> None:
        """Hand `exc` to whoever waits: for the answer's head, else for its body."""
        head, body = self.head, self._body
        if not head.done():
            head.set_exception(exc)
        elif not body.is_eof() and body.exception() is None:
            body.set_exception(exc)

    def _take_head(self, data: bytes) -> bytes:
        """Parse the answer's head (and any interim heads before it) from `data`; return
        the bytes after it if its body is chunked. Whether they go to the parser or to a
        ChunkedBody is decided by the head, so a chunked head (and the head of an answer
        to HEAD) is fed alone; any other answer is fed whole, as it came."""
        while self._mode is None and self._parser is not None:
            end = _head_end(self._carry, data)
            if end < 0:  # all of it is head (or not HTTP: the parser says so)
                self._carry = (self._carry + data)[-3:]
                self._head_bytes += len(data)
                if self._head_bytes > _MAX_HEAD:
                    self._fail_malformed("the head is too long")
                else:
                    self._parse(data)
                return b""
            self._carry, self._head_bytes = b"", 0
            self._alone = self._method == "HEAD" or data.find(b"chunked", 0, end) >= 0
            if not self._alone:
                self._parse(data)
                return b""
            self._parse(data[:end])
            data = data[end:]
            if not data:
                break
        if self._mode is _NONE and data:  # bytes after a HEAD's answer
            self.should_close = True
        return data if self.chunked is not None else b""

    def chunk_received(self, data: bytes, relay: Relaying | None) -> None:
        """A chunked body's bytes: passed on as they came when they hold whole chunks and
        a relay can take them now, else decoded into the reader (which pauses the socket
        when it is full)."""
        chunked, body = self.chunked, self._body
        if chunked.done:  # bytes after the answer: the connection is not reused
            self.should_close = True
            return
        try:
            pieces, whole = chunked.feed(data)
        except ChunkError as exc:
            self._fail_malformed(f"invalid chunked body: {exc}")
            return
        if relay is None or whole is None or not relay.forward(whole):
            for piece in pieces:
                body.feed(piece)
        elif not chunked.done:
            return  # passed on: nothing waits in the reader
        if chunked.done:
            self.should_close = self.should_close or chunked.overrun
            body.feed_eof()
        if relay is not None:
            relay.drain()

    def _parse(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:  # dropped, or failed: nothing more on this connection is read
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # a 101's head: nothing after it is HTTP
            self.should_close = True
            self._mode = _NONE
        except httptools.HttpParserError as exc:
            cause = exc.__context__ if isinstance(exc, httptools.HttpParserCallbackError) else exc
            self._fail_malformed(f"invalid answer: {cause}")

    def _fail_malformed(self, why: str) -> None:
        """Nothing more on this connection is trusted."""
        self._parser = None
        self._host.close()
        self.fail(Malformed(why))

    # httptools' callbacks
    def on_message_begin(self) -> None:
        if self._mode is not None:  # a second answer: nobody asked for it
            self.should_close = True

    def on_status(self, status: bytes) -> None:
        self._status_bytes += len(status)
        if self._status_bytes > MAX_LINE:
            raise Malformed("the status line is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > MAX_LINE:  # as aiohttp counts a field
            raise Malformed("a header field is too long")
        if len(self._fields) >= MAX_FIELDS:
            raise Malformed("too many header fields")
        if b"\x00" in value:
            raise Malformed("a NUL in a header value")
        self._fields.append(
            (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        )

    def on_headers_complete(self) -> None:
        parser = self._parser
        if not parser.should_keep_alive():
            self.should_close = True
        status = parser.get_status_code()
        fields, self._fields, self._status_bytes = self._fields, [], 0
        if status in _INTERIM and status != 101:
            return  # e.g. 100 Continue: the final answer follows
        if self._mode is not None or self.head.done():  # an answer nobody waits for
            self.should_close = True
            self._host.close()
            return
        headers = CIMultiDictProxy(CIMultiDict(fields))
        self.head.set_result((Head(status, headers), self._start_body(status, headers)))

    def _start_body(self, status: int, headers: CIMultiDictProxy[str]) -> BodyReader:
        """How the body after this final head is read, and its reader."""
        if status in _NO_BODY_STATUS or status == 101 or self._method == "HEAD":
            self._mode = _NONE
            self._body = empty_body()
            return self._body
        chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        if chunked:
            self._cut = TransferEncodingError
        if chunked and self._alone:
            self._mode = _CHUNKED
            self.chunked = ChunkedBody()
        else:
            self._mode = _PARSER
            self._until_close = not chunked and "Content-Length" not in headers
        return self._body

    def on_body(self, data: bytes) -> None:
        if self._mode is _PARSER:
            self._body.feed(data)
        else:  # bytes after a bodiless answer
            self.should_close = True

    def on_message_complete(self) -> None:
        if self._mode is _PARSER:
            self._body.feed_eof()
            self._mode = _NONE


def _parser(answer: Answer) -> httptools.HttpResponseParser:
    """A parser as lenient as aiohttp's client's (its "lax" response parser)."""
    parser = httptools.HttpResponseParser(answer)
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
