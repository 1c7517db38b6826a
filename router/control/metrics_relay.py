"""The counted series of a router of several processes, merged once: the collector
serves them on a Unix socket of the run directory, and a worker's /metrics fetches them
there and adds its own part (the backends' states, the process's numbers).

Every process writes its counters and histograms to files of its own, and the page
sums them. Merging keeps a state (~50 MiB at 1,024 backends) and, first, creates every
backend's series at 0 in the merging process (~140 a backend): in each worker that
answered a scrape, that was paid once per worker; here it is paid once for the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import aiohttp
from aiohttp import web

from router.errors import MetricsUnavailable
from router.metrics import Metrics

#: how long a worker waits for the collector's merge (its first at 1,024 backends took
#: ~3.5 s: every file decoded, every backend's series primed)
WAIT_SECONDS = 30.0
_PATH = "/counted"


class CountedServer:
    """The collector's side: one merge at a time (the merged state is one)."""

    def __init__(self, metrics: Metrics, path: str) -> None:
        self._metrics = metrics
        self._path = path
        self._lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Listen (a socket left by a collector that died is replaced)."""
        app = web.Application()
        app.router.add_get(_PATH, self._counted)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        await web.UnixSite(self._runner, self._path).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _counted(self, request: web.Request) -> web.Response:
        async with self._lock:
            body = await self._metrics.counted_off_loop()
        return web.Response(body=body)


class CountedClient:
    """A worker's side: `Metrics.counted_elsewhere`."""

    def __init__(self, path: str, wait: float = WAIT_SECONDS) -> None:
        self._path = path
        self._timeout = aiohttp.ClientTimeout(total=wait)
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self) -> bytes:
        """The collector's page of counted series; MetricsUnavailable if it has none to
        give in time."""
        if self._session is None:
            connector = aiohttp.UnixConnector(path=self._path)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        try:
            async with self._session.get(f"http://collector{_PATH}") as resp:
                if resp.status == 200:
                    return await resp.read()
                why = f"it answered HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise MetricsUnavailable(
            f"The router's collector, which merges every process's metrics, did not "
            f"give them ({why}); it may be restarting. Scrape again."
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
