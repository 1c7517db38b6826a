"""A bare TCP pipe on uvloop: the floor under any Python proxy on this machine.

Each client connection gets a connection of its own to the backend, and bytes flow both
ways untouched, straight from the protocols' callbacks: no HTTP parsing, no routing, no
task, timer or metric per request, flow control only. bench.studies.throughput measures it
beside the routers. What kvroute adds over it is the cost of being an HTTP router; what
the pipe itself costs (the event loop's wake-ups and the kernel's reads and writes) no
Python proxy on this machine can go below.

    python -m bench.studies.pipe --backend http://127.0.0.1:8001 --port 9000

Not a study of its own: the "bare TCP pipe" row of docs/performance.md, "Throughput
beside the Rust routers" (bench.studies.throughput starts it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import uvloop
from yarl import URL


class _Side(asyncio.Protocol):
    """One end of the pipe: what it reads is written to the other end."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.peer.transport.write(data)

    def pause_writing(self) -> None:  # the other end waits until this one drains
        self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.close()
        self.transport = None


class _Client(_Side):
    """The accepted end: what it reads before the backend end is connected waits."""

    def __init__(self, backend: URL) -> None:
        super().__init__()
        self._backend = backend
        self._early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport.pause_reading()
        asyncio.get_running_loop().create_task(self._connect())

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self._early.append(data)
        else:
            self.peer.transport.write(data)

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, backend = await loop.create_connection(
                _Side, self._backend.raw_host, self._backend.port
            )
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        if self.transport is None:  # the client left meanwhile
            backend.transport.close()
            return
        backend.peer, self.peer = self, backend
        backend.transport.writelines(self._early)
        self._early.clear()
        self.transport.resume_reading()


async def serve(backend: URL, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(backend), host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", required=True, help="the backend's URL (http://host:port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(URL(args.backend), args.host, args.port))


if __name__ == "__main__":
    main()
