"""A request's body, read within the limits: it must arrive within `body_timeout`
(408), stop at `max_body_bytes` (413, read no further) and fit in the bodies' budget
(body_budget.py, 503). Its bytes stay reserved in the budget while they are held.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.hdrs import CONTENT_ENCODING
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.streams import StreamReader

from router import log
from router.config import LimitsConfig
from router.errors import BadRequest, PayloadTooLarge, RequestTimeout
from router.ingress.body_budget import BodyBudget, worker_share


class BodyReader:
    """The bodies aiohttp reads; its budget and its 408 serve the fast path too."""

    __slots__ = ("_max_body", "_timeout", "bodies")

    def __init__(self, limits: LimitsConfig, workers: int) -> None:
        self._max_body = limits.max_body_bytes
        self._timeout = limits.body_timeout
        #: request bodies held at once: this worker's share of the router's budget
        self.bodies = BodyBudget(
            worker_share(limits.max_buffered_body_bytes, workers, limits.max_body_bytes)
        )

    async def read(self, request: web.Request) -> bytes:
        """The body within the limits; its bytes stay reserved in `bodies` (the caller
        gives them back)."""
        length = request.content_length
        if (err := self.declared_too_large(length)) is not None:
            raise err
        content = request.content
        if content.is_eof():  # it all came with the headers: no timer, no copy
            body = content.read_nowait()
            self.bodies.take(len(body))
            return body
        try:
            async with asyncio.timeout(self._timeout):
                return await self._receive(content, length or 0)
        except TimeoutError:
            raise self.late() from None
        except web.RequestPayloadError as exc:  # e.g. a body that is not the gzip it claims
            raise _unreadable(request, exc) from None

    async def _receive(self, content: StreamReader, declared: int) -> bytes:
        """Read a body as it comes, its bytes reserved in `bodies` before they are held:
        the declared length at once, what a chunked or decoded body brings beyond it as
        it comes. All of it is given back if reading fails."""
        bodies = self.bodies
        bodies.take(declared)
        reserved, size, chunks = declared, 0, []
        try:
            while chunk := await content.readany():
                size += len(chunk)
                if size > self._max_body:  # e.g. chunked, or inflated from gzip
                    raise self._too_large()
                if size > reserved:
                    bodies.take(size - reserved)
                    reserved = size
                chunks.append(chunk)
        except BaseException:
            bodies.give(reserved)
            raise
        bodies.give(reserved - size)
        return b"".join(chunks)

    @property
    def max_body(self) -> int:
        return self._max_body

    def late(self) -> RequestTimeout:
        return RequestTimeout(f"The request body did not arrive within {self._timeout:g} s.")

    def declared_too_large(self, length: int | None) -> PayloadTooLarge | None:
        """The 413 for a body declared larger than the limit, before any of it is read."""
        if length is None or length <= self._max_body:
            return None
        return PayloadTooLarge(
            f"Request body of {length} bytes exceeds the limit of {self._max_body} bytes."
        )

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"Request body exceeds the limit of {self._max_body} bytes.")


def _unreadable(request: web.Request, exc: web.RequestPayloadError) -> BadRequest:
    """What the client hears of a body aiohttp could not read; aiohttp's own words go to
    the log (at debug: a client's fault, on an error path only)."""
    log.http.debug("request body unreadable: %r, caused by %r", exc, exc.__cause__)
    if isinstance(exc.__cause__, ContentEncodingError):
        encoding = request.headers.get(CONTENT_ENCODING, "")
        return BadRequest(
            f"The request body is not valid {encoding}, as its Content-Encoding says."
        )
    return BadRequest("The request body does not match its framing (chunks or length).")
