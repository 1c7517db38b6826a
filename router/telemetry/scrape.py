"""/metrics scraping: the few vLLM series routing needs, per backend, kept fresh.

`Scraper` runs one scrape loop per backend (a slow or dead backend never delays the
others), jittered around `scrape_interval`. It reads only the vLLM series routing needs
(vllm-telemetry.md §1): running and waiting requests summed over the `engine` label,
KV usage maxed over it, prefix-cache and prompt-token counters, the inter-token latency
histogram's sum and count, and `cache_config_info` for the block size and block count
(the index capacity). Old names (`gpu_cache_usage_perc`, `gpu_prefix_cache_*`,
`time_per_output_token_seconds`) are accepted. Data older than `stale_after` counts as
absent: the backend's `waiting` drops to 0 and a labelled fallback counter says why.

Two scrapes in a row give a decode sample (`decoded_between`): the backend's own count
of every stream's tokens, the router's or not, for its learned speed
(router/fleet/speeds.py).
"""

from __future__ import annotations

import asyncio
import functools
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from router import log
from router.fleet.backends import Backend, Fleet
from router.fleet.speeds import MIN_DECODE_TOKENS

#: a GET of a path on a backend: its body when it answers 200, else None
#: (router/upstream/pages.py)
PageGet = Callable[[Backend, str], Awaitable[bytes | None]]

_SUMMED = {
    b"vllm:num_requests_running": "running",
    b"vllm:num_requests_waiting": "waiting",
    b"vllm:prefix_cache_queries_total": "prefix_queries",
    b"vllm:prefix_cache_hits_total": "prefix_hits",
    b"vllm:gpu_prefix_cache_queries_total": "prefix_queries",
    b"vllm:gpu_prefix_cache_hits_total": "prefix_hits",
    b"vllm:external_prefix_cache_hits_total": "external_hits",
    b"vllm:prompt_tokens_total": "prompt_tokens",
    b"vllm:inter_token_latency_seconds_sum": "itl_sum",
    b"vllm:inter_token_latency_seconds_count": "itl_count",
}
#: the inter-token histogram's name before vLLM 0.11, read where the new one is absent
_LEGACY_ITL = {
    b"vllm:time_per_output_token_seconds_sum": 0,
    b"vllm:time_per_output_token_seconds_count": 1,
}
_MAXED = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")
_CACHE_INFO = b"vllm:cache_config_info"
#: a line of one of those series (not of a longer name starting with one): its name,
#: its labels (empty without) and its value
_ROUTING_LINE = re.compile(
    rb"\n("
    + b"|".join(re.escape(n) for n in (*_SUMMED, *_MAXED, *_LEGACY_ITL, _CACHE_INFO))
    + rb")(?:\{([^}\n]*)\})? ([^\n]*)"
)


@dataclass
class VllmSnapshot:
    """What one scrape of a vLLM /metrics page says, summed or maxed over engines."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    external_hits: float = 0.0
    #: every prompt token, cached or not
    prompt_tokens: float = 0.0
    #: the seconds between a stream's tokens, summed, and their count
    itl_sum: float = 0.0
    itl_count: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    at: float = field(default_factory=time.monotonic)


def parse_vllm_metrics(page: bytes) -> VllmSnapshot:
    """The routing series of a Prometheus text page, found in one regular-expression pass
    over it: the page's other lines (histogram buckets mostly) are never split or read,
    where splitting every line was most of the collector's work at a thousand backends
    scraped every second."""
    snap = VllmSnapshot()
    legacy = [0.0, 0.0]
    for name, labels, value in _ROUTING_LINE.findall(b"\n" + page):
        if name in _SUMMED:
            attr = _SUMMED[name]
            setattr(snap, attr, getattr(snap, attr) + _number(value))
        elif name in _MAXED:
            snap.kv_usage = max(snap.kv_usage, _number(value))
        elif name in _LEGACY_ITL:
            legacy[_LEGACY_ITL[name]] += _number(value)
        else:
            snap.block_size, snap.num_gpu_blocks = _cache_config(labels)
    if not snap.itl_count:
        snap.itl_sum, snap.itl_count = legacy
    return snap


def decoded_between(before: VllmSnapshot, after: VllmSnapshot) -> tuple[float, float, float] | None:
    """A decode sample of the span between two scrapes (speeds.py `decoded`): the
    requests decoding there on average, the mean gap between a stream's tokens, and
    the uncached prompt tokens prefilled per engine step. The summed gaps over the span
    are the time integral of the requests decoding, so over its length they are their
    mean. None when too few tokens came, the backend was idle at either end (its mean
    would count idle time), or a counter went back (a restart)."""
    seconds = after.at - before.at
    tokens = after.itl_count - before.itl_count
    gaps = after.itl_sum - before.itl_sum
    computed = (after.prompt_tokens - after.prefix_hits - after.external_hits) - (
        before.prompt_tokens - before.prefix_hits - before.external_hits
    )
    if tokens < MIN_DECODE_TOKENS or gaps <= 0 or seconds <= 0 or computed < 0:
        return None
    if not (before.running and after.running):
        return None
    running = gaps / seconds
    return running, gaps / tokens, computed * running / tokens


def _number(value: bytes) -> float:
    try:
        return float(value.split()[0])
    except (ValueError, IndexError):
        return 0.0


@functools.lru_cache(maxsize=4096)
def _cache_config(labels: bytes) -> tuple[int | None, int | None]:
    """The block size and block count of a `cache_config_info` line's labels: read once
    per distinct line (a backend's settings are the same scrape after scrape)."""
    info = _labels(labels.decode(errors="replace"))
    return _int(info.get("block_size")), _int(info.get("num_gpu_blocks"))


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
        get: PageGet,
        interval: float,
        stale_after: float,
        on_fallback: Callable[[str, str], None],
        on_snapshot: Callable[[str, VllmSnapshot], None] | None = None,
        on_decoded: Callable[[Backend, tuple[float, float, float]], None] | None = None,
    ) -> None:
        self._fleet = fleet
        self._get = get
        self._interval = interval
        self._stale_after = stale_after
        self._on_fallback = on_fallback
        self._on_snapshot = on_snapshot
        self._on_decoded = on_decoded
        self.snapshots: dict[str, VllmSnapshot] = {}

    async def run(self, scrape: bool = True) -> None:
        """Scrape every member (unless snapshots come from elsewhere) and expire."""
        tasks: dict[str, asyncio.Task] = {}
        try:
            while True:
                if scrape:
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
                page = await self._get(backend, "/metrics")
        except TimeoutError:
            page = None
        if page is None:
            self._on_fallback(backend.name, "scrape_failed")
            return None
        snap = parse_vllm_metrics(page)
        self.keep(backend, snap)
        if self._on_snapshot is not None:
            self._on_snapshot(backend.name, snap)
        return snap

    def keep(self, backend: Backend, snap: VllmSnapshot) -> None:
        """A fresh snapshot of `backend`, scraped here or received from the collector."""
        before = self.snapshots.get(backend.name)
        self.snapshots[backend.name] = snap
        backend.waiting, backend.kv_usage = snap.waiting, snap.kv_usage
        backend.unstarted_at_scrape = backend.unstarted
        backend.batch.observe(snap.running, snap.waiting, backend.inflight)
        if before is not None and self._on_decoded is not None:
            sample = decoded_between(before, snap)
            if sample is not None:
                self._on_decoded(backend, sample)

    def _expire(self) -> None:
        now = time.monotonic()
        for backend in self._fleet.members:
            snap = self.snapshots.get(backend.name)
            if (
                snap is not None
                and now - snap.at > self._stale_after
                and backend.unstarted_at_scrape is not None
            ):
                backend.waiting = backend.kv_usage = 0.0
                backend.unstarted_at_scrape = None
                backend.batch.forget()
                self._on_fallback(backend.name, "stale_metrics")
                log.backends.warning("metrics of %s are stale", backend.name)


def describe(snap: VllmSnapshot | None) -> dict | None:
    """A backend's last scrape, for /debug/routing; None before the first one."""
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
