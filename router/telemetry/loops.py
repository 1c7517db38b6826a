"""The telemetry loops of one router process, beside the request path.

`Telemetry` runs the scraper (router/telemetry/scrape.py) and the index upkeep
(router/telemetry/index_upkeep.py). For backends with `kv_events` configured it feeds
the KV-aware policy's prefix index from their events; the others stay in approximate
mode, where the index learns from the router's own decisions (which mode each backend
is in is the `kvroute_backend_index_mode` gauge).

It has one form per process role: `LocalTelemetry` watches the backends itself (a
router alone), `CollectorTelemetry` watches them for several workers and feeds them
(router/telemetry/collector_feed.py), `WorkerTelemetry` follows that feed
(router/telemetry/worker_feed.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import zmq.asyncio

from hashing.tiered_index import TieredIndex
from router.config import KvEventsConfig, TelemetryConfig
from router.fleet.backends import Backend, Fleet
from router.metrics import Metrics
from router.telemetry.index_upkeep import Held, IndexUpkeep, subscribe
from router.telemetry.kv_events import kv_context
from router.telemetry.scrape import PageGet, Scraper, VllmSnapshot, describe


@dataclass(frozen=True)
class Parts:
    """What every form of telemetry works on: the fleet it keeps informed, how it reads
    a backend's page (/metrics), where it counts, its settings, and each backend's KV
    event endpoints in the current config."""

    fleet: Fleet
    get: PageGet
    metrics: Metrics
    config: TelemetryConfig
    kv_events: Callable[[], dict[str, KvEventsConfig]]


class Telemetry:
    """Starts and stops the telemetry loops of one process; never on the request path."""

    #: whether this process scrapes the backends (a worker of several is sent snapshots)
    scrapes = True

    def __init__(self, parts: Parts) -> None:
        fleet, config = parts.fleet, parts.config
        self._fleet = fleet
        self._metrics = parts.metrics
        self._config = config
        self._zmq: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task] = []
        self._scraper = Scraper(
            fleet,
            parts.get,
            config.scrape_interval,
            config.stale_after,
            self._fallback,
            self._scraped,
            self._decoded,
        )
        upkeep = (
            fleet,
            parts.metrics,
            parts.kv_events,
            self._scraper.snapshots,
            self._source,
            self.scrapes,
        )
        self._upkeep = IndexUpkeep(*upkeep)

    def start(self) -> None:
        if self._config.enabled:
            scrape = self._scraper.run(scrape=self.scrapes)
            self._tasks.append(asyncio.create_task(scrape, name="kvroute-scrape"))
        self._tasks.extend(self._role_tasks())
        self._tasks.append(asyncio.create_task(self._upkeep.run(), name="kvroute-index"))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._upkeep.tasks()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._close()
        if self._zmq is not None:
            self._zmq.destroy(linger=0)

    def describe(self, backend: str) -> dict | None:
        """The backend's last scrape, for /debug/routing; None before the first one."""
        return describe(self._scraper.snapshots.get(backend))

    def push_nowait(self, payload: bytes) -> None:
        """A routing hint for the other workers: alone, there are none."""

    def _role_tasks(self) -> list[asyncio.Task]:
        """The loops this role runs besides scraping and index upkeep."""
        return []

    def _close(self) -> None:
        """Sockets of the role's own, closed once its loops are cancelled."""

    def _context(self) -> zmq.asyncio.Context:
        if self._zmq is None:
            self._zmq = kv_context()
        return self._zmq

    def _fallback(self, backend: str, reason: str) -> None:
        self._metrics.telemetry_fallbacks.labels(backend, reason).inc()

    def _scraped(self, backend: str, snap: VllmSnapshot) -> None:
        """A fresh snapshot scraped here (the collector publishes it)."""

    def _decoded(self, backend: Backend, sample: tuple[float, float, float]) -> None:
        """A decode sample of two scrapes in a row: learned from here."""
        self._fleet.scraped_decode(backend, sample, record=True)

    def _source(self, backend: Backend, cfg: KvEventsConfig, index: TieredIndex) -> Held:
        """The backend's KV events, subscribed to here."""
        fleet, tally = self._fleet, self._metrics.kv_events_applied
        return subscribe(self._context(), fleet, backend, cfg, index, self._fallback, None, tally)


class LocalTelemetry(Telemetry):
    """A router alone: it scrapes and subscribes to every backend itself."""
