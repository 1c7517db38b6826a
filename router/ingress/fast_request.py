"""The fast path's look at a request's first read: is it one the fast path answers?

httptools (llhttp, through its public callback API) parses the read. A common request -
POST to a generation endpoint, HTTP/1.1, whose head came whole, with a Content-Length
body within the body limit, no Content-Encoding, Expect, Upgrade or Transfer-Encoding,
nothing after its body - is returned with what came of its body; for anything else
(another path, a split head, a malformed request, one near or over the header limits,
pipelined requests) the answer is None, and aiohttp's server takes the connection, whose
own parser then applies the limits exactly (431, 400).
"""

from __future__ import annotations

from collections.abc import Mapping

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from router.request import Kind

ROUTES = {
    "/v1/chat/completions": Kind.CHAT,
    "/v1/completions": Kind.COMPLETION,
    "/v1/embeddings": Kind.EMBEDDING,
}
#: what a request line holds besides its target: "POST ", " HTTP/1.1", CRLF
_LINE_EXTRA = 16
#: headers the fast path leaves to aiohttp's server: they ask it to decode, answer
#: first, or change the protocol
_NOT_PLAIN = ("Content-Encoding", "Expect", "Upgrade", "Transfer-Encoding")
#: fields aiohttp's server refuses twice in one request (400)
_SINGLETONS = frozenset(
    {
        b"content-length",
        b"content-location",
        b"content-range",
        b"content-type",
        b"etag",
        b"host",
        b"max-forwards",
        b"server",
        b"transfer-encoding",
        b"user-agent",
    }
)


class _Unusual(Exception):
    """The request is near or over a limit: aiohttp's server decides."""


class Request:
    """A common request's head, and the part of its body its first read held."""

    __slots__ = ("arrived", "headers", "kind", "length", "method", "path", "should_close")

    def __init__(
        self,
        kind: Kind,
        path: str,
        headers: CIMultiDictProxy[str],
        arrived: bytes,
        length: int,
        should_close: bool,
    ) -> None:
        self.kind = kind
        self.method = "POST"
        self.path = path
        self.headers = headers
        self.arrived = arrived
        self.length = length  # the body's declared length
        self.should_close = should_close


class _Reader:
    """httptools' callbacks for one request: its target, fields and body, within limits
    kept a little under aiohttp's, and aiohttp's own checks (NUL in a value, a singleton
    field twice), so that whatever aiohttp would refuse goes to it."""

    __slots__ = (
        "body",
        "fields",
        "keep_alive",
        "max_field",
        "max_headers",
        "max_url",
        "parser",
        "seen",
        "url",
    )

    def __init__(self, limits: Mapping[str, int]) -> None:
        self.max_url = limits.get("max_line_size", 8190) - _LINE_EXTRA
        self.max_field = limits.get("max_field_size", 8190) - 2
        self.max_headers = limits.get("max_headers", 128) - 1
        self.url = b""
        self.fields: list[tuple[str, str]] = []
        self.body: list[bytes] = []
        self.seen: set[bytes] = set()  # the singleton fields met
        self.keep_alive = False
        self.parser = httptools.HttpRequestParser(self)

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.max_url:
            raise _Unusual

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) > self.max_field or len(value) > self.max_field:
            raise _Unusual
        if len(self.fields) >= self.max_headers or b"\x00" in value:
            raise _Unusual
        key = name.lower()
        if key in _SINGLETONS:
            if key in self.seen:
                raise _Unusual
            self.seen.add(key)
        self.fields.append(
            (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        )

    def on_headers_complete(self) -> None:
        # asked here: once the message is complete, llhttp has moved on to the next one
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)


def common_request(data: bytes, limits: Mapping[str, int], max_body: int) -> Request | None:
    """The request `data` holds, if the fast path serves it (see the module's docstring)."""
    if not data.startswith(b"POST "):
        return None
    end = data.find(b"\r\n\r\n")
    if end < 0:  # a split head (or not HTTP/1.1 as clients write it)
        return None
    reader = _Reader(limits)
    parser = reader.parser
    try:
        parser.feed_data(data)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        return None
    finally:
        reader.parser = None  # no cycle of parser and callbacks left for the GC
    path = reader.url.decode("utf-8", "surrogateescape")
    kind = ROUTES.get(path)
    if kind is None or parser.get_http_version() != "1.1":
        return None
    headers = CIMultiDictProxy(CIMultiDict(reader.fields))
    length = headers.get("Content-Length", "0")
    if any(name in headers for name in _NOT_PLAIN) or not length.isdigit():
        return None
    size = int(length)
    # more than the request in this read: a pipelined request, which aiohttp serves
    if size > max_body or len(data) > end + 4 + size:
        return None
    arrived = b"".join(reader.body)
    return Request(kind, path, headers, arrived, size, not reader.keep_alive)
