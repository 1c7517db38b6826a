"""Wiring: build the pieces from a Config, start them in order, stop them in reverse."""

from __future__ import annotations

import asyncio
import contextlib
import signal

from aiohttp import web

import policies
from router import log
from router.backends import Fleet
from router.config import Config
from router.dispatch import Dispatcher
from router.health import ModelPoller
from router.http_ingress import HttpIngress, errors_middleware
from router.metrics import Metrics
from router.proxy import make_session

_STARTUP_POLL_SECONDS = 3.0


class Router:
    """One router instance: HTTP listener, backend fleet, policy, metrics, loops."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.fleet = Fleet(config.backends, policies.create(config.routing))
        self.metrics = Metrics(lambda: self.fleet.members)
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def url(self) -> str:
        return f"http://{self.config.listen.host}:{self.port}"

    async def start(self) -> None:
        cfg = self.config
        self._session = make_session(cfg.timeouts.connect)
        poller = ModelPoller(
            self.fleet, self._session, cfg.models_refresh_interval, _STARTUP_POLL_SECONDS
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(poller.poll_once(), _STARTUP_POLL_SECONDS)
        self._tasks.append(asyncio.create_task(poller.run(), name="kvroute-models"))
        self.dispatcher = Dispatcher(cfg, self.fleet, self.metrics, self._session)
        app = web.Application(
            client_max_size=cfg.limits.max_body_bytes, middlewares=[errors_middleware]
        )
        app.add_routes(HttpIngress(cfg, self.fleet, self.dispatcher, self.metrics).routes())
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.listen.host, cfg.listen.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.server.info(
            "kvroute listening on %s, strategy %s, %d backends",
            self.url,
            self.dispatcher.strategy,
            len(self.fleet.members),
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        await self._session.close()


async def serve(config: Config) -> None:
    """Run until SIGINT or SIGTERM."""
    router = Router(config)
    await router.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.server.info("shutting down")
        await router.stop()
