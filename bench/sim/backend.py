"""One simulated vLLM server's state: its engine, LoRA adapters, fault and KV event
publisher, and its life (start, stop, restart, faults).

The routes themselves live in server.py, which reads this state (what they report of
it: reports.py); fleet.py builds the
backends and hands each its app (`start(make_app(backend))`), so neither the backend nor
its server imports the fleet, and the server imports the backend only.
"""

import asyncio
import socket
import time

from aiohttp import web

from bench.sim.engine import EngineStats, SimEngine
from bench.sim.lora import LoraAdapters
from bench.sim.params import NO_FAULT, Fault, SimParams
from bench.sim.publisher import KVEventPublisher


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
        #: when it started, as its model cards say
        self.created = int(time.time())
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
