"""Backend telemetry beside the request path: /metrics scraping and KV event subscriptions.

`Telemetry` runs one scrape loop per backend (a slow or dead backend never delays the
others), jittered around `scrape_interval`. It reads only the vLLM series routing needs
(vllm-telemetry.md §1): running and waiting requests summed over the `engine` label,
KV usage maxed over it, prefix-cache counters, and `cache_config_info` for the block
size and block count (the index capacity). Old names (`gpu_cache_usage_perc`,
`gpu_prefix_cache_*`) are accepted. Data older than `stale_after` counts as absent: the
backend's `waiting` drops to 0 and a labelled fallback counter says why.

For backends with `kv_events` configured it starts a subscriber feeding the KV-aware
policy's prefix index (router/telemetry/kv_events.py); the others stay in approximate mode, where
the index learns from the router's own decisions. Which mode each backend is in is the
`kvroute_backend_index_mode` gauge.

With several workers (router/control/supervisor.py) the work is done once: the collector process
scrapes and subscribes, and publishes on a ZMQ PUB socket (IPC) each snapshot
(`s`, backend, msgpack snapshot), each KV batch in sequence order after its gap checks
and replays (`k`, backend, payload as the backend sent it) and each index reset
(`c`, backend); every worker's `Telemetry` follows that feed instead of the backends
and applies batches to its own index. The collector applies them to an index of its own
too.

The same feed carries the collector's health verdicts and model lists (`p`, after each
probe round, after backends joined its fleet, and to every worker that says hello;
router/fleet/health.py `Verdicts`: only the collector probes; a worker's `REFUSED` message
marks a backend down there and publishes them at once), the admin API's runtime edits
(worker 0 pushes an edit to the collector's PULL socket, `broadcast`; the collector
applies it too, so it scrapes, subscribes to and probes an added backend, and publishes
it, `a`) and the collector's own edits (`announce`: the discovered backends, `a` too);
each worker hands an edit to `on_broadcast`.

PUB/SUB drops what is published before a subscription reaches the publisher, so a
worker does not serve until its feed is live: it pushes hellos (`hello <n>`) to the
control socket until the collector's welcome comes back on a topic only that worker
subscribes to (`w<n>.`): `j` (joined), the runtime edits that bring a restarted worker's
file-based config to the router's (`e`: backend list, drains), and a snapshot of the
collector's index per backend with events (`i`, published in order with the batches,
so the worker goes on from there). `joined` waits for it, bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from hashing.prefix_index import PrefixIndex
from router import log
from router.config import KvEventsConfig, TelemetryConfig
from router.context import WorkerContext
from router.fleet.backends import Backend, Fleet
from router.fleet.health import REFUSED, Verdicts
from router.fleet.placements import LEARNED, decode_learned
from router.metrics import Metrics
from router.telemetry.kv_events import EventApplier, EventSubscriber, run_forever

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
_BROADCAST_TIMEOUT_S = 2.0
_HELLO_INTERVAL_S = 0.05
_HELLO = b"hello "  # + the worker's index; an admin edit is a JSON object


def _worker_topic(worker: bytes) -> bytes:
    """The feed topic of what one joining worker alone needs (`.` ends it: w1 is not w10)."""
    return b"w" + worker + b"."


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
        on_fallback: Callable[[str, str], None],
        on_snapshot: Callable[[str, VllmSnapshot], None] | None = None,
    ) -> None:
        self._fleet = fleet
        self._session = session
        self._interval = interval
        self._stale_after = stale_after
        self._on_fallback = on_fallback
        self._on_snapshot = on_snapshot
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
                async with self._session.get(backend.url.with_path("/metrics")) as resp:
                    text = await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, UnicodeDecodeError):
            text = None
        if text is None:
            self._on_fallback(backend.name, "scrape_failed")
            return None
        snap = parse_vllm_metrics(text)
        self.keep(backend, snap)
        if self._on_snapshot is not None:
            self._on_snapshot(backend.name, snap)
        return snap

    def keep(self, backend: Backend, snap: VllmSnapshot) -> None:
        """A fresh snapshot of `backend`, scraped here or received from the collector."""
        self.snapshots[backend.name] = snap
        backend.waiting = snap.waiting

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


class _Forwarder:
    """The collector's EventApplier: in-order batches go to the workers, and to the
    collector's own index (the snapshot a late worker starts from)."""

    def __init__(
        self, applier: EventApplier, backend: str, publish: Callable[[list[bytes]], None]
    ) -> None:
        self._applier = applier
        self._name = backend.encode()
        self._publish = publish
        self.stats = applier.stats

    def apply_payload(self, payload: bytes) -> None:
        self._publish([b"k", self._name, payload])
        self._applier.apply_payload(payload)


class Telemetry:
    """Starts and stops every telemetry loop of one router; never on the request path.

    `link` is None for a single-process router, else this process's place among the
    workers (router/control/supervisor.py).
    """

    def __init__(
        self,
        fleet: Fleet,
        session: aiohttp.ClientSession,
        metrics: Metrics,
        config: TelemetryConfig,
        kv_events: Callable[[], dict[str, KvEventsConfig]],
        link: WorkerContext | None = None,
        on_broadcast: Callable[[bytes], None] | None = None,
        verdicts: Verdicts | None = None,
        replay: Callable[[], list[bytes]] = list,
    ) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self._config = config
        self._kv_events = kv_events
        self._link = link
        self._feed = None if link is None else link.feed
        self._collector = link is not None and link.collector
        self._on_broadcast = on_broadcast
        self._verdicts = verdicts
        self._replay = replay  # the collector: edits that bring a joining worker up to date
        self._verdicts_ready = False  # the collector: its first probe round is done
        self._zmq: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._push_now: zmq.Socket | None = None  # `push_nowait`'s: sends never wait
        if self._collector:
            self._pub = self._context().socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, 100_000)
            self._pub.bind(self._feed)
        self._scraper = Scraper(
            fleet,
            session,
            config.scrape_interval,
            config.stale_after,
            self._fallback,
            self._publish_snapshot if self._collector else None,
        )
        #: per backend: its subscription task and the endpoints it was started with
        self._subscribers: dict[str, tuple[asyncio.Task, KvEventsConfig]] = {}
        #: a worker's appliers of the batches the collector forwards, per backend
        self._appliers: dict[str, tuple[EventApplier, KvEventsConfig]] = {}
        self._tasks: list[asyncio.Task] = []
        self._index: PrefixIndex | None = None
        self._joined = asyncio.Event()  # a worker's feed delivers (see `joined`)
        self._me = b"" if link is None else str(link.index).encode()
        self._topic = _worker_topic(self._me)

    @property
    def _follower(self) -> bool:
        """A worker: telemetry arrives from the collector, not from the backends."""
        return self._feed is not None and not self._collector

    def start(self) -> None:
        if self._config.enabled:
            scrape = self._scraper.run(scrape=not self._follower)
            self._tasks.append(asyncio.create_task(scrape, name="kvroute-scrape"))
        if self._follower:
            self._tasks.append(asyncio.create_task(self._follow(), name="kvroute-feed"))
        if self._collector:
            self._tasks.append(asyncio.create_task(self._relay(), name="kvroute-control"))
        self._tasks.append(asyncio.create_task(self._maintain(), name="kvroute-index"))

    async def stop(self) -> None:
        tasks = [*self._tasks, *(task for task, _ in self._subscribers.values())]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._push_now is not None:  # a shadow context's socket: destroy does not see it
            self._push_now.close(linger=0)
        self._link = None  # `push_nowait` sends nothing from here on
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

    def _context(self) -> zmq.asyncio.Context:
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        return self._zmq

    def _fallback(self, backend: str, reason: str) -> None:
        if not self._follower:  # the collector counts the router's downgrades once
            self._metrics.telemetry_fallbacks.labels(backend, reason).inc()

    def _publish(self, frames: list[bytes]) -> None:
        """Never blocks: a worker too slow to keep up loses messages, not the collector."""
        self._pub.send_multipart(frames, flags=zmq.NOBLOCK)

    def _publish_snapshot(self, backend: str, snap: VllmSnapshot) -> None:
        self._publish([b"s", backend.encode(), msgspec.msgpack.encode(snap)])

    async def _welcome(self, topic: bytes) -> None:
        """The collector's answer to a worker's hello, on that worker's topic: `j` (its feed
        is live), the runtime edits the file does not know (`e`), the index of every
        backend with events (`i`, ordered with the batches, so the worker goes on from
        there); and the verdicts, to everyone.

        The index goes one backend at a time, the loop free in between: a large fleet's
        index takes seconds to encode, and meanwhile the KV subscribers must keep draining
        their sockets (a backend drops events past its send queue). A batch forwarded in
        between is in the snapshots taken after it, and a worker's restore replaces that
        backend's keys whole, so it ends where the collector is."""
        self._publish([topic, b"j"])
        for edit in self._replay():
            self._publish([topic, b"e", edit])
        self.verdicts_changed()
        if self._index is not None:
            for name in list(self._subscribers):
                pairs = msgspec.msgpack.encode(self._index.snapshot(name))
                self._publish([topic, b"i", name.encode(), pairs])
                await asyncio.sleep(0)

    def publish_verdicts(self) -> None:
        """The collector: send its health verdicts and model lists to every worker."""
        self._verdicts_ready = True
        self._publish([b"p", b"", self._verdicts.encode()])

    def verdicts_changed(self) -> None:
        """The collector: publish the verdicts again, once its first probe round is done
        (e.g. backends a reload or edit added joined with their admission check)."""
        if self._verdicts_ready:
            self.publish_verdicts()

    def announce(self, payload: bytes) -> None:
        """The collector: an edit of its own (the discovered backends) to every worker."""
        self._publish([b"a", b"", payload])

    async def broadcast(self, payload: bytes) -> None:
        """Send `payload` to every worker (this one included) through the collector."""
        if self._push is None:
            self._push = self._context().socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 0)
            self._push.connect(self._link.control)
        async with asyncio.timeout(_BROADCAST_TIMEOUT_S):
            await self._push.send(payload)

    def push_nowait(self, payload: bytes) -> None:
        """Send `payload` to every worker through the collector without waiting: dropped
        if the collector is not keeping up (a routing hint, never an edit)."""
        if self._link is None:
            return
        if self._push_now is None:
            self._push_now = zmq.Context.shadow(self._context().underlying).socket(zmq.PUSH)
            self._push_now.setsockopt(zmq.LINGER, 0)
            self._push_now.connect(self._link.control)
        with contextlib.suppress(zmq.Again):
            self._push_now.send(payload, flags=zmq.NOBLOCK)

    async def _relay(self) -> None:
        """The collector: what workers push to the control socket goes to every worker.

        An admin edit is applied here too (the collector scrapes, subscribes and probes
        the backends it adds); a hello is answered, with the verdicts once known.
        """
        pull = self._context().socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(self._link.control)
        try:
            while True:
                payload = await pull.recv()
                if payload.startswith(LEARNED):  # a worker's placements: to the others
                    self._publish([b"l", b"", payload])
                    continue
                if payload.startswith(REFUSED):  # nothing listens: down for every worker
                    if self._verdicts.refused(payload):
                        self.verdicts_changed()
                    continue
                if not payload.startswith(_HELLO):
                    self._publish([b"a", b"", payload])
                    self._on_broadcast(payload)
                    continue
                await self._welcome(_worker_topic(payload[len(_HELLO) :]))
        finally:
            pull.close()

    async def _follow(self) -> None:
        """A worker: apply what the collector publishes."""
        sub = self._context().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        for topic in (b"s", b"k", b"c", b"a", b"p", b"l", self._topic):
            sub.setsockopt(zmq.SUBSCRIBE, topic)  # not the other workers' snapshots
        sub.connect(self._feed)
        hello = asyncio.create_task(self._hello())
        try:
            while True:
                kind, name, *rest = await sub.recv_multipart()
                self._received(kind, name.decode(), rest)
        finally:
            hello.cancel()
            sub.close()

    async def _hello(self) -> None:
        """Say hello to the collector until its answer comes back on the feed."""
        while not self._joined.is_set():
            with contextlib.suppress(TimeoutError):  # the collector is not up yet
                await self.broadcast(_HELLO + self._me)
            await asyncio.sleep(_HELLO_INTERVAL_S)

    async def joined(self, timeout: float) -> bool:
        """A worker: wait until its feed is live (True), at most `timeout` seconds."""
        try:
            async with asyncio.timeout(timeout):
                await self._joined.wait()
        except TimeoutError:
            return False
        return True

    def _welcomed(self, what: str, rest: list[bytes]) -> None:
        """What the collector sent this worker alone (see `_welcome`)."""
        if what == "j":  # nothing published from here on is missed
            self._joined.set()
        elif what == "e":
            self._on_broadcast(rest[0])
        elif what == "i" and (index := getattr(self._fleet.policy, "index", None)) is not None:
            index.restore(rest[0].decode(), msgspec.msgpack.decode(rest[1]))

    def _received(self, kind: bytes, name: str, rest: list[bytes]) -> None:
        if kind == b"s":
            backend = self._fleet.find(name)
            if backend is not None:
                self._scraper.keep(backend, msgspec.msgpack.decode(rest[0], type=VllmSnapshot))
        elif kind == b"k" and name in self._appliers:
            self._appliers[name][0].apply_payload(rest[0])
        elif kind == b"c" and self._index is not None:
            self._index.cleared(name)
            log.backends.warning("KV index of %s cleared (collector's reset)", name)
        elif kind == b"l":
            self._learned(rest[0])
        elif kind == b"a" and self._on_broadcast is not None:
            self._on_broadcast(rest[0])
        elif kind == b"p" and self._verdicts is not None:
            self._verdicts.adopt(rest[0])
        elif kind == self._topic:
            self._welcomed(name, rest)

    def _learned(self, payload: bytes) -> None:
        """Another worker's placements, into this worker's index for their whole TTL."""
        worker, placed = decode_learned(payload)
        index = getattr(self._fleet.policy, "index", None)
        if index is None or worker == self._link.index:
            return
        for backend, expires_at, keys in placed:
            index.learn(backend, keys, expires_at)

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
        current = self._appliers if self._follower else self._subscribers
        for name, (held, cfg) in list(current.items()):
            if fresh_index or name not in wanted or endpoints[name] != cfg:
                if isinstance(held, asyncio.Task):
                    held.cancel()
                del current[name]
        for name, backend in wanted.items():
            if name not in current:
                current[name] = (self._subscribe(backend, endpoints[name], index), endpoints[name])
        policy.event_backends = set(current)
        for backend in self._fleet.members:
            self._metrics.index_mode(backend.name, backend.name in current)

    def _subscribe(
        self, backend: Backend, cfg: KvEventsConfig, index: PrefixIndex
    ) -> asyncio.Task | EventApplier:
        """A subscription to the backend's events; a worker only needs their applier."""
        block_size = self._fleet.policy.params.block_size
        applier = EventApplier(backend.name, index, block_size, lambda: _base_model(backend))
        if self._follower:
            return applier
        sink = _Forwarder(applier, backend.name, self._publish) if self._collector else applier

        def reset(why: str) -> None:
            index.cleared(backend.name)
            if self._collector:
                self._publish([b"c", backend.name.encode()])
            self._fallback(backend.name, "event_reset")
            log.backends.warning("KV index of %s cleared: %s", backend.name, why)

        sub = EventSubscriber(
            self._context(), sink, cfg.endpoint, cfg.replay_endpoint, cfg.topic, reset
        )
        return asyncio.create_task(
            run_forever(sub, backend.name), name=f"kvroute-kv-{backend.name}"
        )
