"""A fleet of K simulated vLLM servers in one process (each a backend.py SimBackend).

A backend = engine (scheduler + KV cache + metrics) + aiohttp server + optional ZMQ KV
event publisher + a fault setting. Every socket is bound before anything is served, with
port 0 meaning "any free port" (the real port is read back). Startup runs in order and
shutdown in reverse: stop the engine (in-flight requests are dropped, hung handlers
released), close the HTTP server, then the ZMQ sockets. A fleet for prefill/decode
disaggregation gives each backend its own `kv_role` (`roles`), and a mixed fleet its own
`speed` (`speeds`); all else is shared.
"""

import asyncio
import socket
from collections.abc import Sequence

import msgspec
import zmq.asyncio

from bench.sim.backend import SimBackend
from bench.sim.params import KVRole, SimParams
from bench.sim.publisher import KVEventPublisher
from bench.sim.server import make_app


class SimFleet:
    """K running backends; `stop()` (or leaving `async with`) shuts them all down."""

    def __init__(self, backends: list[SimBackend], zmq_ctx: zmq.asyncio.Context | None) -> None:
        self.backends = backends
        self._zmq_ctx = zmq_ctx

    @property
    def urls(self) -> list[str]:
        return [b.url for b in self.backends]

    async def stop(self) -> None:
        await asyncio.gather(*(b.stop() for b in reversed(self.backends)))
        if self._zmq_ctx is not None:
            self._zmq_ctx.term()

    async def __aenter__(self) -> "SimFleet":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def start_fleet(
    n: int,
    params: SimParams | None = None,
    host: str = "127.0.0.1",
    base_port: int = 0,
    roles: Sequence[KVRole] | None = None,
    speeds: Sequence[float] | None = None,
) -> SimFleet:
    """Start `n` simulated vLLM servers on `host`; backend i listens on base_port + i.

    base_port 0 picks free ports (read them from `fleet.urls`). With params.kv_events,
    backend i publishes on kv_events_base_port + i and serves replay on
    kv_events_base_port + n + i (free ports when that is 0). `roles`, one per backend,
    overrides params.kv_role, e.g. ["prefill", "decode"] for a 1P1D fleet; `speeds`, one
    per backend, overrides params.speed, e.g. [1, 1, 0.5, 0.5] for a mixed fleet.
    """
    params = params or SimParams()
    if roles is not None and len(roles) != n:
        raise ValueError(f"{len(roles)} roles for {n} backends")
    if speeds is not None and len(speeds) != n:
        raise ValueError(f"{len(speeds)} speeds for {n} backends")
    ctx = zmq.asyncio.Context() if params.kv_events else None
    fleet = SimFleet([], ctx)
    try:
        for i in range(n):
            sock = _listen(host, base_port + i if base_port else 0)
            try:
                publisher = _publisher(ctx, params, host, sock.getsockname()[1], i, n)
            except BaseException:
                sock.close()
                raise
            own = _own(params, i, roles, speeds)
            backend = SimBackend(i, own, sock, publisher)
            fleet.backends.append(backend)
            await backend.start(make_app(backend))
    except BaseException:
        await fleet.stop()
        raise
    return fleet


def _own(
    params: SimParams, i: int, roles: Sequence[KVRole] | None, speeds: Sequence[float] | None
) -> SimParams:
    """Backend i's params: the fleet's, with its own role and speed where given."""
    own: dict[str, object] = {}
    if roles is not None:
        own["kv_role"] = roles[i]
    if speeds is not None:
        own["speed"] = speeds[i]
    return msgspec.structs.replace(params, **own) if own else params


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _publisher(
    ctx: zmq.asyncio.Context | None, params: SimParams, host: str, port: int, i: int, n: int
) -> KVEventPublisher | None:
    if ctx is None:
        return None
    base = params.kv_events_base_port
    return KVEventPublisher(
        ctx,
        host=host,
        pub_port=base + i if base else 0,
        replay_port=base + n + i if base else 0,
        topic=params.kv_events_topic.format(host=host, port=port, model=params.model),
        encoding=params.kv_events_encoding,
        buffer_steps=params.kv_events_buffer_steps,
        hwm=params.kv_events_hwm,
    )
