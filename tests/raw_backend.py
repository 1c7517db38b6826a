"""A backend on a raw socket that records each request exactly as its bytes arrived.

Why not the aiohttp stub: aiohttp parses and normalises what it receives (header case,
the request target), so a test of what the router forwards must look at the bytes. It
answers every request with `answer` (health checks and model polls included).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

JSON_OK = b'{"object": "list", "data": [{"id": "stub-model", "object": "model"}]}'


def json_answer(body: bytes = JSON_OK, extra: bytes = b"") -> bytes:
    """A 200 with a JSON body; `extra`: more header lines, each ending in CRLF."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    return head + b"Content-Length: %d\r\n%s\r\n" % (len(body), extra) + body


@dataclass
class Received:
    """One request: its request line and its header lines, as sent."""

    line: bytes
    headers: list[tuple[bytes, bytes]]

    @property
    def target(self) -> bytes:
        return self.line.split(b" ")[1]

    def named(self, name: bytes) -> list[bytes]:
        """The values of every header called `name` (any case)."""
        return [value for key, value in self.headers if key.lower() == name.lower()]


@dataclass
class RawBackend:
    answer: bytes = field(default_factory=json_answer)
    received: list[Received] = field(default_factory=list)
    port: int = 0
    _server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def proxied(self) -> list[Received]:
        """What the router forwarded for clients (its health checks and polls left out)."""
        probes = (b"GET /health ", b"GET /v1/models ", b"GET /metrics ")
        return [r for r in self.received if not r.line.startswith(probes)]

    async def start(self) -> RawBackend:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                line, *fields = head[:-4].split(b"\r\n")
                headers = [tuple(f.split(b":", 1)) for f in fields]
                request = Received(line, [(k, v.strip()) for k, v in headers])
                self.received.append(request)
                length = request.named(b"content-length")
                await reader.readexactly(int(length[0]) if length else 0)
                writer.write(self.answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
