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
from typing import NamedTuple

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from router.request import Kind
from router.upstream.head import decoded

ROUTES = {
    "/v1/chat/completions": Kind.CHAT,
    "/v1/completions": Kind.COMPLETION,
    "/v1/embeddings": Kind.EMBEDDING,
}
#: what a request line holds besides its target: "POST ", " HTTP/1.1", CRLF
_LINE_EXTRA = 16
#: headers the fast path leaves to aiohttp's server: they ask it to decode, answer
#: first, or change the protocol
_NOT_PLAIN = frozenset({b"content-encoding", b"expect", b"upgrade", b"transfer-encoding"})
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


class Request:
    """A common request's head, and the part of its body its first read held."""

    __slots__ = ("arrived", "headers", "kind", "length", "path", "should_close")

    def __init__(
        self,
        kind: Kind,
        path: str,
        headers: CIMultiDictProxy[str],
        arrived: bytes,
        length: int,
        should_close: bool,
    ) -> None:
        self.kind = kind  # the method is POST
        self.path = path
        self.headers = headers
        self.arrived = arrived
        self.length = length  # the body's declared length
        self.should_close = should_close


class Limits(NamedTuple):
    """aiohttp's server's limits, a little lowered: a request the fast path takes is one
    aiohttp would take too."""

    url: int
    field: int
    fields: int

    @classmethod
    def of(cls, parser_limits: Mapping[str, int]) -> Limits:
        """From the limits given to aiohttp's parser (router/ingress/web.py)."""
        return cls(
            parser_limits.get("max_line_size", 8190) - _LINE_EXTRA,
            parser_limits.get("max_field_size", 8190) - 2,
            parser_limits.get("max_headers", 128) - 1,
        )


class _Reader:
    """httptools' callbacks for one request: its target, raw fields and body (checked
    once the read is parsed, in one pass)."""

    __slots__ = ("body", "fields", "keep_alive", "parser", "url")

    def __init__(self) -> None:
        self.url = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.keep_alive = False
        self.parser = httptools.HttpRequestParser(self)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        # asked here: once the message is complete, llhttp has moved on to the next one
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)


def common_request(data: bytes, limits: Limits, max_body: int) -> Request | None:
    """The request `data` holds, if the fast path serves it (see the module's docstring)."""
    if not data.startswith(b"POST "):
        return None
    end = data.find(b"\r\n\r\n")
    # a split head (or not HTTP/1.1 as clients write it); a NUL, which aiohttp refuses
    if end < 0 or data.find(b"\x00", 0, end) >= 0:
        return None
    reader = _Reader()
    parser = reader.parser
    try:
        parser.feed_data(data)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        return None
    finally:
        reader.parser = None  # no cycle of parser and callbacks left for the GC
    path = reader.url.decode("utf-8", "surrogateescape")
    kind = ROUTES.get(path)
    raw = reader.fields
    if kind is None or len(reader.url) > limits.url or parser.get_http_version() != "1.1":
        return None
    if not _plain(raw, end, limits):
        return None
    headers = CIMultiDictProxy(CIMultiDict(decoded(raw)))
    length = headers.get("Content-Length", "0")
    if not length.isdigit():
        return None
    size = int(length)
    # more than the request in this read: a pipelined request, which aiohttp serves
    if size > max_body or len(data) > end + 4 + size:
        return None
    arrived = b"".join(reader.body)
    return Request(kind, path, headers, arrived, size, not reader.keep_alive)


def _plain(raw: list[tuple[bytes, bytes]], head: int, limits: Limits) -> bool:
    """Within `limits` (a `head` bytes long can exceed none), no field that asks aiohttp
    to decode, answer first or change the protocol, no singleton field twice."""
    if len(raw) > limits.fields:
        return False
    if head > limits.field and any(len(n) > limits.field or len(v) > limits.field for n, v in raw):
        return False
    keys = [name.lower() for name, _ in raw]
    if not _NOT_PLAIN.isdisjoint(keys):
        return False
    if len(set(keys)) == len(keys):
        return True
    twice = [key for key in keys if key in _SINGLETONS]
    return len(set(twice)) == len(twice)
