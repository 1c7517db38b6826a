"""The fast path's answers, written straight to the client connection's transport.

One `transport.write` per message (head and body together; one per SSE chunk,
chunked-encoded). A stream is relayed from the backend connection's own callback into
the transport (`Upstream.relay`, router/upstream/relay.py; FastReply is the sink), and a
client that reads slowly pauses the backend's socket through the body reader's limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Protocol

from router.upstream.proxy import Sink, header_lines

_REASONS = {s.value: s.phrase for s in HTTPStatus}
_LAST_CHUNK = b"0\r\n\r\n"


class Client(Protocol):
    """The client connection an answer goes to (router/ingress/fast.py)."""

    transport: asyncio.Transport | None
    writing_paused: bool
    on_resume: Callable[[], None] | None

    def closes(self) -> bool:
        """Whether the connection closes after this answer (it says `Connection: close`)."""

    def close_after_answer(self) -> None:
        """Close the connection once this answer is out."""

    async def drain(self) -> None: ...


class FastReply:
    """A Reply written straight to the connection's transport; streamed bodies are
    relayed into it by the backend connection itself (it is their Sink)."""

    __slots__ = ("_client", "started")

    def __init__(self, client: Client) -> None:
        self._client = client
        self.started = False

    @property
    def sink(self) -> Sink:
        return self

    def _head(self, status: int, headers: Mapping[str, str], framing: str) -> bytes:
        connection = "Connection: close\r\n" if self._client.closes() else ""
        reason = _REASONS.get(status, "")
        return (
            f"HTTP/1.1 {status} {reason}\r\n{header_lines(headers)}{framing}{connection}\r\n"
        ).encode("latin-1", "surrogateescape")

    async def whole(
        self, status: int, headers: Mapping[str, str], body: bytes, close: bool = False
    ) -> None:
        if close:
            self._client.close_after_answer()
        self.started = True
        await self._write(self._head(status, headers, f"Content-Length: {len(body)}\r\n") + body)

    async def begin(self, status: int, headers: Mapping[str, str]) -> None:
        self.started = True
        await self._write(self._head(status, headers, "Transfer-Encoding: chunked\r\n"))

    def send(self, chunk: bytes) -> Awaitable[None] | None:
        """One chunk, one write; the caller awaits only when the socket's buffer is full."""
        self.put(chunk)
        return None if self.ready() else self._client.drain()

    async def end(self) -> None:
        await self._write(_LAST_CHUNK)

    # the Sink Upstream.relay writes to, from the backend connection's callbacks
    def put(self, chunk: bytes) -> None:
        if chunk:
            self._raw(b"%x\r\n%b\r\n" % (len(chunk), chunk))

    def put_framed(self, chunks: bytes) -> None:
        self._raw(chunks)

    def ready(self) -> bool:
        return not self._client.writing_paused

    def on_ready(self, callback: Callable[[], None] | None) -> None:
        self._client.on_resume = callback

    async def _write(self, data: bytes) -> None:
        self._raw(data)
        if not self.ready():
            await self._client.drain()

    def _raw(self, data: bytes) -> None:
        transport = self._client.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        transport.write(data)
