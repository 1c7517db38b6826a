"""One backend answer read off its connection: where its body goes, and how it ends.

The bytes go through `AnswerParser` (router/upstream/head.py, httptools) until the final
head is in. A chunked body is then decoded by `ChunkedBody` (router/upstream/chunked.py)
instead of the parser, so that a read of whole chunks can be passed on to a relay as the
backend framed it; any other body is decoded by the parser. Either way the body goes
into a `BodyReader`, whose limit pauses the backend's socket.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple, Protocol

from multidict import CIMultiDictProxy

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
from router.upstream.head import AnswerParser

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
    the body's reader; `should_close` tells whether the connection can be reused.

    Whole past ~150 lines by design: its methods are the parser's and the connection's
    callbacks on every read of the answer, over the same few fields (a split would add
    a call per read)."""

    __slots__ = (
        "_body",
        "_cut",
        "_host",
        "_method",
        "_mode",
        "_parser",
        "chunked",
        "head",
        "should_close",
    )

    def __init__(
        self,
        host: Host,
        loop: asyncio.AbstractEventLoop,
        method: str,
        spare: AnswerParser | None = None,
    ) -> None:
        self._host = host
        self._method = method
        if spare is None:
            self._parser = AnswerParser(self, method == "HEAD")
        else:  # the previous answer's, between two messages: made once per connection
            self._parser = spare
            spare.restart(self, method == "HEAD")
        self._body = BodyReader(host, loop)
        self._mode: int | None = None  # how the body is read, once the final head is in
        #: what a body cut short fails with (None: it ends where the connection does)
        self._cut: type[Cut] | None = ContentLengthError
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
        parser = self._parser
        if not parser.final:
            data = parser.take_head(data)  # what follows a head fed alone, if anything
        if data:
            mode = self._mode
            if mode is _CHUNKED:
                self.chunk_received(data, relay)
                return
            if mode is _PARSER:
                parser.parse(data)
            else:  # bytes after a bodiless answer: the connection is not reused
                self.should_close = True
        if relay is not None:
            relay.drain()

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
            self.malformed(f"invalid chunked body: {exc}")
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

    def drop(self) -> AnswerParser | None:
        """The exchange is over: nothing more is parsed into this answer. Returns the
        parser if the next answer on the connection can use it."""
        parser = self._parser
        if parser.reusable and not self.should_close:
            return parser
        parser.drop()
        return None

    def lost(self, exc: BaseException | None) -> None:
        """The connection ended: a body read until then ends, any other one was cut."""
        self.should_close = True
        self._parser.drop()
        body = self._body
        if self.head.done() and not body.is_eof():
            if self._cut is None:
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

    # what the parser tells (router/upstream/head.py's Reading)
    def headed(self, status: int, headers: CIMultiDictProxy[str], alone: bool) -> None:
        if self.head.done():  # nobody waits for it any more (a timeout, a client gone)
            self.should_close = True
            self._host.close()
            return
        mode = self._mode = _framing(status, headers, self._method, alone)
        if mode is _NONE:
            self._body = empty_body()
        elif mode is _CHUNKED:
            self.chunked = ChunkedBody()
        if "chunked" in headers.get("Transfer-Encoding", "").lower():
            self._cut = TransferEncodingError
        elif "Content-Length" not in headers:
            self._cut = None  # the body ends where the connection does
        self.head.set_result((Head(status, headers), self._body))

    def piece(self, data: bytes) -> None:
        if self._mode is _PARSER:
            self._body.feed(data)
        else:  # bytes after a bodiless answer
            self.should_close = True

    def ended(self) -> None:
        if self._mode is _PARSER:
            self._body.feed_eof()
            self._mode = _NONE

    def upgraded(self) -> None:
        self.should_close = True
        self._mode = _NONE

    def malformed(self, why: str) -> None:
        self._parser.drop()
        self._host.close()
        self.fail(Malformed(why))


def _framing(status: int, headers: CIMultiDictProxy[str], method: str, alone: bool) -> int:
    """How the body after a final head is read; `alone`: the head was fed by itself."""
    if status in _NO_BODY_STATUS or status == 101 or method == "HEAD":
        return _NONE
    if alone and "chunked" in headers.get("Transfer-Encoding", "").lower():
        return _CHUNKED
    return _PARSER
