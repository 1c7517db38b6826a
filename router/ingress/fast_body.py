"""A fast-path request's body, as `HttpIngress.serve` reads it: reserved in the body
budget when asked for, and read from the socket only then.

A body still coming when its head was served is not read until `serve` asks for it,
after the token check and with its size reserved: a refused request (401, 503) costs no
more than the one read its head came in. Once asked, the body must be whole within
`body_timeout` (else 408). After an answer that left it unread, what still comes of it
is dropped for a moment before the close (`linger`), as aiohttp's lingering close does.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from router.ingress.body_budget import BodyBudget
from router.ingress.web import HttpIngress


class WholeBody:
    """A body that came whole with its head: its bytes reserved in the body budget when
    `serve` reads it."""

    __slots__ = ("_bodies", "_body")

    def __init__(self, body: bytes, bodies: BodyBudget) -> None:
        self._body = body
        self._bodies = bodies

    async def __call__(self) -> bytes:
        self._bodies.take(len(self._body))
        return self._body


class Settings(Protocol):
    """The fast path's settings a body is read under (router/ingress/fast.py)."""

    ingress: HttpIngress
    body_timeout: float
    linger: float


class Client(Protocol):
    """The client connection the body comes on (router/ingress/fast.py)."""

    def resume_reading(self) -> None: ...

    def close(self) -> None: ...

    def body_received(self) -> None:
        """The body is whole (or given up on): the connection reads requests again."""


class BodyReceiver:
    """A Content-Length body still coming when its head was served."""

    __slots__ = ("_body", "_chunks", "_client", "_got", "_loop", "_settings", "_size", "_timer")

    def __init__(
        self,
        client: Client,
        settings: Settings,
        loop: asyncio.AbstractEventLoop,
        arrived: bytes,
        size: int,
    ) -> None:
        self._client = client
        self._settings = settings
        self._loop = loop
        self._size = size
        self._got = len(arrived)
        self._chunks: list[bytes] | None = [arrived]  # None: dropping them (lingering)
        self._body: asyncio.Future[bytes] = loop.create_future()
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(self) -> bytes:
        settings = self._settings
        settings.ingress.bodies.take(self._size)
        self._timer = self._loop.call_later(settings.body_timeout, self._late)
        self._client.resume_reading()
        try:
            return await self._body
        except BaseException:
            settings.ingress.bodies.give(self._size)
            raise

    def feed(self, data: bytes) -> bytes:
        """Take the body's part of `data`; return what came after it."""
        need = self._size - self._got
        if len(data) > need:
            data, rest = data[:need], data[need:]
        else:
            rest = b""
        self._got += len(data)
        whole = self._got == self._size
        if self._chunks is None:  # lingering
            if whole:
                self._client.close()
            return b""
        self._chunks.append(data)
        if whole:
            self._body.set_result(b"".join(self._chunks))
            self._client.body_received()
        return rest

    def linger(self) -> None:
        """Drop what still comes of the body for a moment, then close: the client reads
        its answer instead of a reset."""
        self.stop()
        self._chunks = None
        self._timer = self._loop.call_later(self._settings.linger, self._client.close)
        self._client.resume_reading()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self._body.done():
            self._body.cancel()

    def _late(self) -> None:
        self._body.set_exception(self._settings.ingress.body_late())
