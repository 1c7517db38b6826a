"""A fleet of K simulated vLLM servers in one process, and the backend that wires one.

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
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq.asyncio
from aiohttp import web

from bench.sim.engine import EngineStats, SimEngine
from bench.sim.lora import LoraAdapters
from bench.sim.params import NO_FAULT, Fault, KVRole, SimParams
from bench.sim.publisher import KVEventPublisher
from bench.sim.request import SimRequest
from bench.sim.server import make_app


class SimBackend:
    """One simulated vLLM server. Use `start_fleet` to build them."""

    def __init__(
        self,
        index: int,
        params: SimParams,
        sock: socket.socket,
        publisher: KVEventPublisher | None,
    ) -> None:
        self.index = index
        self.params = params
        self.host, self.port = sock.getsockname()[:2]
        self.publisher = publisher
        self.engine = SimEngine(params, publisher)
        self.loras = LoraAdapters(params)
        self.fault = NO_FAULT
        self.inflight = 0  # HTTP generation requests in progress (GET /load)
        self._sock = sock
        self._dropped = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._created = int(time.time())
        self.set_fault(params.faults.get(index, NO_FAULT))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine_id(self) -> str:
        """The id a decode instance is told to read this backend's KV from (stable)."""
        return f"sim-{self.host}-{self.port}"

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    async def start(self) -> None:
        self.engine.start()
        self._runner = web.AppRunner(
            make_app(self), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        await web.SockSite(self._runner, self._sock).start()

    async def stop(self) -> None:
        await self.engine.stop()
        self._dropped.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.publisher is not None:
            await self.publisher.close()

    def set_fault(self, fault: Fault) -> None:
        self.fault = fault
        self.engine.slow_factor = fault.factor if fault.mode == "slow" else 1.0

    def restart(self) -> None:
        """Like a process restart: requests die, cache, metrics, event seq and fault reset."""
        self.engine.restart()
        self.loras.reset()
        self.set_fault(NO_FAULT)
        self._dropped.set()
        self._dropped = asyncio.Event()

    async def wait_dropped(self) -> None:
        """Return when the backend restarts or stops (what a hung request waits for)."""
        await self._dropped.wait()

    def lora_id(self, model: str | None) -> int | None:
        """None for the base model (or no name), else the 1-based adapter id.

        Raises ValueError for a name this server does not serve.
        """
        if not model or model == self.params.model:
            return None
        try:
            return self.loras.id(model)
        except KeyError:
            raise ValueError(model) from None

    def model_cards(self) -> list[dict[str, Any]]:
        """GET /v1/models `data`: the base model, then one card per LoRA adapter."""
        base = self.params.model
        adapters = [(n, self.loras.root(n), base) for n in self.loras.names]
        return [self._card(*card) for card in [(base, base, None), *adapters]]

    def kv_transfer_params(self, req: SimRequest) -> dict[str, Any] | None:
        """What a finished prefill for a remote decode tells the decode instance."""
        if not req.remote_decode:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": req.remote_block_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": req.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
        }

    def kv_event_sources(self) -> dict[str, Any]:
        if self.publisher is None:
            return {}
        p = self.params
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.publisher.endpoint,
            "replay_endpoint": self.publisher.replay_endpoint,
            "buffer_steps": p.kv_events_buffer_steps,
            "hwm": p.kv_events_hwm,
            "max_queue_size": 100000,
            "topic": self.publisher.topic,
        }
        return {"0": config}

    def snapshot(self) -> dict[str, Any]:
        """GET /sim/stats: totals plus the live state of the engine."""
        e = self.engine
        live = {
            "running": e.num_running,
            "waiting": e.num_waiting,
            "inflight": self.inflight,
            "kv_cache_usage": e.kv.usage,
            "cached_blocks": e.kv.num_cached,
            "cpu_cached_blocks": e.kv.num_cpu_cached,
            "fault": msgspec.to_builtins(self.fault),
            "kv_role": self.params.kv_role,
            "lora_loads": self.loras.loads,
            "lora_unloads": self.loras.unloads,
            "loaded_adapters": self.loras.names,
            "loading_adapters": self.loras.loading,
            "true_speeds": self.true_speeds(),
        }
        return {**msgspec.to_builtins(self.stats), **live}

    def true_speeds(self) -> dict[str, float | None]:
        """What a router could learn about this backend, in simulated time: prefill tokens
        per second, and a decode step's time (base + per sequence in the batch), for
        `speed` and any `slow` fault now in force. A router observes wall-clock time:
        multiply durations (divide rates) by `time_scale` to compare."""
        p = self.params
        pace = p.speed / self.engine.slow_factor
        return {
            "speed": pace,
            "prefill_tokens_per_s": 1000.0 * pace / p.prefill_per_token_ms
            if p.prefill_per_token_ms
            else None,
            "decode_step_base_ms": p.step_base_ms / pace,
            "decode_per_seq_ms": p.decode_per_seq_ms / pace,
            "time_scale": p.time_scale,
        }

    def _card(self, name: str, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self._created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": self.params.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{name}",
                    "object": "model_permission",
                    "created": self._created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }


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
            await backend.start()
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
