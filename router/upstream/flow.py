"""Flow control for the router's own asyncio protocols (the backend connections here, the
fast path's client connections in router/ingress/fast.py).

What aiohttp's internal BaseProtocol gave them, kept here so that no aiohttp internals
sit on the request path: writes wait (`drain`) while the transport's buffer is full, and
a buffer the protocol cannot empty yet (a body its reader lags behind, bytes a client
sent before its answer) pauses the socket until it is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

#: what pause_reading/resume_reading raise on a transport without flow control
_NO_FLOW_CONTROL = (AttributeError, NotImplementedError, RuntimeError)


class FlowProtocol(asyncio.Protocol):
    """An asyncio protocol whose writes can wait for the socket and whose reads can pause."""

    __slots__ = (
        "_drain_waiter",
        "_loop",
        "on_resume",
        "reading_paused",
        "transport",
        "writing_paused",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._drain_waiter: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None
        self.writing_paused = False
        self.reading_paused = False
        #: called when the transport's buffer drains again (a relayed stream waits for it)
        self.on_resume: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is None or waiter.done():
            return
        if exc is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(ConnectionResetError("the connection was lost"))

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.on_resume is not None:
            self.on_resume()

    async def drain(self) -> None:
        """Return once the transport's buffer took what was written (at once if it did)."""
        if self.transport is None:
            raise ConnectionResetError("the connection was lost")
        if not self.writing_paused:
            return
        if self._drain_waiter is None:
            self._drain_waiter = self._loop.create_future()
        await self._drain_waiter

    def pause_reading(self) -> None:
        """Stop reading the socket: a buffer of this protocol is full."""
        self.reading_paused = True
        if self.transport is not None:
            with contextlib.suppress(_NO_FLOW_CONTROL):
                self.transport.pause_reading()

    def resume_reading(self) -> None:
        """Read the socket again: the buffer was emptied."""
        self.reading_paused = False
        if self.transport is not None:
            with contextlib.suppress(_NO_FLOW_CONTROL):
                self.transport.resume_reading()
