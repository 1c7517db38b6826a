"""One simulated vLLM server's state: its engine, LoRA adapters, fault and KV event
publisher, and what its HTTP routes report about them.

The routes themselves live in server.py, which reads this state; fleet.py builds the
backends and hands each its app (`start(make_app(backend))`), so neither the backend nor
its server imports the fleet, and the server imports the backend only.
"""

import asyncio
import socket
import time
from typing import Any

import msgspec
from aiohttp import web

from bench.sim.engine import EngineStats, SimEngine
from bench.sim.lora import LoraAdapters
from bench.sim.params import NO_FAULT, Fault, SimParams
from bench.sim.protocol import model_card
from bench.sim.publisher import KVEventPublisher
from bench.sim.request import SimRequest


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

    async def start(self, app: web.Application) -> None:
        """Run the engine, then serve `app` (the server's routes over this backend)."""
        self.engine.start()
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
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
        return [
            model_card(*card, self._created, self.params.max_model_len)
            for card in [(base, base, None), *adapters]
        ]

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
