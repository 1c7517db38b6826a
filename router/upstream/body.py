"""A backend answer's body between the socket and its reader, with flow control.

What aiohttp's internal StreamReader did on this path, and only that: the connection
feeds decoded body bytes in, a reader takes them out (all that is buffered at once), and
a reader that lags behind pauses the backend's socket (above twice `READ_LIMIT` bytes
buffered) until it has read the buffer below `READ_LIMIT` again.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from router.upstream.failures import BackendBroke

READ_LIMIT = 2**16  # body bytes buffered before the socket pauses (as aiohttp's default)


class Pausable(Protocol):
    """The connection a body comes from (router/upstream/flow.py's FlowProtocol)."""

    reading_paused: bool

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class BodyReader:
    """One answer's body: bytes fed as they are decoded, read as they are wanted."""

    __slots__ = ("_buffer", "_eof", "_exception", "_loop", "_source", "_waiter", "size", "total")

    def __init__(self, source: Pausable | None, loop: asyncio.AbstractEventLoop | None) -> None:
        self._source = source
        self._loop = loop
        self._buffer: list[bytes] = []
        self.size = 0  # bytes buffered
        self.total = 0  # bytes fed, ever
        self._eof = False
        self._exception: BackendBroke | None = None
        self._waiter: asyncio.Future[None] | None = None

    def feed(self, data: bytes) -> None:
        self._buffer.append(data)
        self.size += len(data)
        self.total += len(data)
        self._wake()
        source = self._source
        if self.size > 2 * READ_LIMIT and not source.reading_paused:
            source.pause_reading()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BackendBroke) -> None:
        self._exception = exc
        self._wake()

    def exception(self) -> BackendBroke | None:
        return self._exception

    def is_eof(self) -> bool:
        """The whole body was fed (it may still wait in the buffer)."""
        return self._eof

    def at_eof(self) -> bool:
        """The whole body was fed and read."""
        return self._eof and not self._buffer

    def read_nowait(self) -> bytes:
        """All that is buffered (b"" if nothing); raises the failure, if any."""
        if self._exception is not None:
            raise self._exception
        buffer = self._buffer
        if not buffer:
            return b""
        data = buffer[0] if len(buffer) == 1 else b"".join(buffer)
        buffer.clear()
        self.size = 0
        source = self._source
        if source is not None and source.reading_paused:
            source.resume_reading()
        return data

    async def readany(self) -> bytes:
        """What is buffered, once there is something; b"" at the end."""
        while not self._buffer and not self._eof and self._exception is None:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.read_nowait()

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def empty_body() -> BodyReader:
    """A body that is known to be empty (HEAD, 204, 304)."""
    body = BodyReader(None, None)
    body.feed_eof()
    return body
