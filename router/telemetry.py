"""Backend telemetry beside the request path: /metrics scraping and KV event subscriptions.

`Telemetry` runs one scrape loop per backend (a slow or dead backend never delays the
others), jittered around `scrape_interval`. It reads only the vLLM series routing needs
(vllm-telemetry.md §1): running and waiting requests summed over the `engine` label,
KV usage maxed over it, prefix-cache counters, and `cache_config_info` for the block
size and block count (the index capacity). Old names (`gpu_cache_usage_perc`,
`gpu_prefix_cache_*`) are accepted. Data older than `stale_after` counts as absent: the
backend's `waiting` drops to 0 and a labelled fallback counter says why.

For backends with `kv_events` configured it starts a subscriber feeding the KV-aware
policy's prefix index (router/kv_events.py); the others stay in approximate mode, where
the index learns from the router's own decisions. Which mode each backend is in is the
`kvroute_backend_index_mode` gauge.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import zmq.asyncio

from hashing.prefix_index import PrefixIndex
from router import log
from router.backends import Backend, Fleet
from router.config import KvEventsConfig, TelemetryConfig
from router.kv_events import EventApplier, EventSubscriber, run_forever
from router.metrics import Metrics

_SUMMED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:gpu_prefix_cache_queries_total": "prefix_queries",
    "vllm:gpu_prefix_cache_hits_total": "prefix_hits",
}
_MAXED = {"vllm:kv_cache_usage_perc": "kv_usage", "vllm:gpu_cache_usage_perc": "kv_usage"}
_CACHE_INFO = "vllm:cache_config_info"


@dataclass
class VllmSnapshot:
    """What one scrape of a vLLM /metrics page says, summed or maxed over engines."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    at: float = field(default_factory=time.monotonic)


def parse_vllm_metrics(text: str) -> VllmSnapshot:
    """Parse the routing series of a Prometheus text page; other lines are skipped fast."""
    snap = VllmSnapshot()
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if not rest:  # a series without labels
            name, _, value = line.partition(" ")
            labels = ""
        else:
            labels, _, value = rest.rpartition("} ")
        if name in _SUMMED:
            attr = _SUMMED[name]
            setattr(snap, attr, getattr(snap, attr) + _number(value))
        elif name in _MAXED:
            snap.kv_usage = max(snap.kv_usage, _number(value))
        elif name == _CACHE_INFO:
            info = _labels(labels)
            snap.block_size = _int(info.get("block_size"))
            snap.num_gpu_blocks = _int(info.get("num_gpu_blocks"))
    return snap


def _number(value: str) -> float:
    try:
        return float(value.split()[0])
    except (ValueError, IndexError):
        return 0.0


def _int(value: str | None) -> int | None:
    try:
        return int(float(value)) if value not in (None, "", "None") else None
    except ValueError:
        return None


def _labels(text: str) -> dict[str, str]:
    out = {}
    for part in text.split('",'):
        key, _, value = part.partition('="')
        out[key.strip().strip(",")] = value.rstrip('"')
    return out


class Scraper:
    """Polls every backend's /metrics and keeps `Backend.waiting` and snapshots fresh."""

    def __init__(
        self,
        fleet: Fleet,
        session: aiohttp.ClientSession,
        interval: float,
        stale_after: float,
        on_fallback,
    ) -> None:
        self._fleet = fleet
        self._session = session
        self._interval = interval
        self._stale_after = stale_after
        self._on_fallback = on_fallback
        self.snapshots: dict[str, VllmSnapshot] = {}

    async def run(self) -> None:
        tasks: dict[str, asyncio.Task] = {}
        try:
            while True:
                self._sync_tasks(tasks)
                await asyncio.sleep(self._interval)
                self._expire()
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

    def _sync_tasks(self, tasks: dict[str, asyncio.Task]) -> None:
        """One loop per current member; loops of removed backends stop."""
        names = {b.name for b in self._fleet.members}
        for name in set(tasks) - names:
            tasks.pop(name).cancel()
            self.snapshots.pop(name, None)
        for backend in self._fleet.members:
            if backend.name not in tasks:
                tasks[backend.name] = asyncio.create_task(self._loop(backend))

    async def _loop(self, backend: Backend) -> None:
        await asyncio.sleep(random.uniform(0, self._interval))  # spread the fleet's scrapes
        while True:
            await self.scrape(backend)
            await asyncio.sleep(self._interval * random.uniform(0.8, 1.2))

    async def scrape(self, backend: Backend) -> VllmSnapshot | None:
        try:
            async with asyncio.timeout(self._stale_after):
                async with self._session.get(backend.url.with_path("/metrics")) as resp:
                    text = await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, UnicodeDecodeError):
            text = None
        if text is None:
            self._on_fallback(backend.name, "scrape_failed")
            return None
        snap = self.snapshots[backend.name] = parse_vllm_metrics(text)
        backend.waiting = snap.waiting
        return snap

    def _expire(self) -> None:
        now = time.monotonic()
        for backend in self._fleet.members:
            snap = self.snapshots.get(backend.name)
            if snap is not None and now - snap.at > self._stale_after and backend.waiting:
                backend.waiting = 0.0
                self._on_fallback(backend.name, "stale_metrics")
                log.backends.warning("metrics of %s are stale", backend.name)


def _base_model(backend: Backend) -> str:
    """The backend's served base model: the root of the event chains that carry no LoRA."""
    for card in backend.model_cards:
        if not card.get("parent"):
            return str(card.get("id", ""))
    return next(iter(sorted(backend.configured_models or ())), "")


class Telemetry:
    """Starts and stops every telemetry loop of one router; never on the request path."""

    def __init__(
        self,
        fleet: Fleet,
        session: aiohttp.ClientSession,
        metrics: Metrics,
        config: TelemetryConfig,
        kv_events: Callable[[], dict[str, KvEventsConfig]],
    ) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self._config = config
        self._kv_events = kv_events
        self._scraper = Scraper(
            fleet, session, config.scrape_interval, config.stale_after, self._fallback
        )
        self._zmq: zmq.asyncio.Context | None = None
        #: per backend: its subscription task and the endpoints it was started with
        self._subscribers: dict[str, tuple[asyncio.Task, KvEventsConfig]] = {}
        self._tasks: list[asyncio.Task] = []
        self._index: PrefixIndex | None = None

    def start(self) -> None:
        if self._config.enabled:
            self._tasks.append(asyncio.create_task(self._scraper.run(), name="kvroute-scrape"))
        self._tasks.append(asyncio.create_task(self._maintain(), name="kvroute-index"))

    async def stop(self) -> None:
        tasks = [*self._tasks, *(task for task, _ in self._subscribers.values())]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._zmq is not None:
            self._zmq.destroy(linger=0)

    def describe(self, backend: str) -> dict | None:
        """The backend's last scrape, for /debug/routing; None before the first one."""
        snap = self._scraper.snapshots.get(backend)
        if snap is None:
            return None
        queries = snap.prefix_queries
        return {
            "running": snap.running,
            "waiting": snap.waiting,
            "kv_cache_usage": snap.kv_usage,
            "prefix_cache_hit_rate": snap.prefix_hits / queries if queries else None,
            "block_size": snap.block_size,
            "num_gpu_blocks": snap.num_gpu_blocks,
            "age_s": round(time.monotonic() - snap.at, 3),
        }

    def _fallback(self, backend: str, reason: str) -> None:
        self._metrics.telemetry_fallbacks.labels(backend, reason).inc()

    async def _maintain(self) -> None:
        """Once a second: subscriptions follow membership, the index ages and resizes."""
        while True:
            index = getattr(self._fleet.policy, "index", None)
            if index is not None:
                self._sync_subscribers(index)
                index.expire(time.monotonic())
                for name, snap in self._scraper.snapshots.items():
                    if snap.num_gpu_blocks:
                        index.set_capacity(name, snap.num_gpu_blocks)
            await asyncio.sleep(1.0)

    def _sync_subscribers(self, index: PrefixIndex) -> None:
        """Subscriptions follow the current config: reloads add, drop or re-point them."""
        policy = self._fleet.policy
        endpoints = self._kv_events()
        wanted = {b.name: b for b in self._fleet.members if b.name in endpoints}
        fresh_index = index is not self._index  # a reload built a new policy
        self._index = index
        for name, (task, cfg) in list(self._subscribers.items()):
            if fresh_index or name not in wanted or endpoints[name] != cfg:
                task.cancel()
                del self._subscribers[name]
        for name, backend in wanted.items():
            if name not in self._subscribers:
                task = self._subscribe(backend, endpoints[name], index)
                self._subscribers[name] = (task, endpoints[name])
        policy.event_backends = set(self._subscribers)
        for backend in self._fleet.members:
            self._metrics.index_mode(backend.name, backend.name in self._subscribers)

    def _subscribe(self, backend: Backend, cfg: KvEventsConfig, index: PrefixIndex) -> asyncio.Task:
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        block_size = self._fleet.policy.params.block_size
        applier = EventApplier(backend.name, index, block_size, lambda: _base_model(backend))

        def reset(why: str) -> None:
            index.cleared(backend.name)
            self._fallback(backend.name, "event_reset")
            log.backends.warning("KV index of %s cleared: %s", backend.name, why)

        sub = EventSubscriber(
            self._zmq, applier, cfg.endpoint, cfg.replay_endpoint, cfg.topic, reset
        )
        return asyncio.create_task(
            run_forever(sub, backend.name), name=f"kvroute-kv-{backend.name}"
        )
