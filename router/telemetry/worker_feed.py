"""A worker's telemetry, with several workers: it follows the collector's feed.

It scrapes nothing and subscribes to nothing: snapshots, KV batches, index resets,
verdicts, the other workers' placements and edits all arrive on the feed
(router/telemetry/feed.py). It says hello until the collector welcomes it (`joined`),
and pushes to the collector's control socket what every worker should hear: admin
edits (`broadcast`), placements and refused connections (`push_nowait`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from hashing.tiered_index import TieredIndex
from router import log
from router.config import KvEventsConfig
from router.context import COLLECTOR, WorkerContext
from router.fleet.backends import Backend
from router.fleet.health import Verdicts
from router.fleet.placements import decode_learned
from router.telemetry.cache_feedback import CacheFeedback
from router.telemetry.cluster_peers import apply_remote_load, apply_shared_speeds
from router.telemetry.feed import (
    BROADCAST_TIMEOUT_S,
    FEED_HWM,
    FOLLOWED,
    HELLO,
    HELLO_INTERVAL_S,
    worker_topic,
)
from router.telemetry.index_upkeep import Held, applier
from router.telemetry.kv_events import drain
from router.telemetry.loops import Parts, Telemetry
from router.telemetry.scrape import VllmSnapshot

#: feed messages applied at once before the loop turns to requests
_DRAIN = 64
#: feed messages a worker could not apply: rare, but each would come with every message
_skipped = log.Throttled(log.server, burst=5, window=60.0)
#: the collector's `s`: [(backend, its snapshot)]
_SNAPSHOTS = msgspec.msgpack.Decoder(list[tuple[str, VllmSnapshot]])
#: the collector's `h`: backend -> (when its events were last applied, when it published)
_HEARD = msgspec.msgpack.Decoder(dict[str, tuple[float, float | None]])


class WorkerTelemetry(Telemetry):
    scrapes = False

    def __init__(
        self,
        parts: Parts,
        link: WorkerContext,
        on_broadcast: Callable[[bytes], None],
        verdicts: Verdicts,
    ) -> None:
        super().__init__(parts)
        self._link: WorkerContext | None = link
        self._on_broadcast = on_broadcast
        self._verdicts = verdicts
        self._push: zmq.asyncio.Socket | None = None
        self._push_now: zmq.Socket | None = None  # `push_nowait`'s: sends never wait
        self._joined = asyncio.Event()  # the feed delivers (see `joined`)
        self._feedback = CacheFeedback(self._fleet, self._metrics)
        self._me = str(link.index).encode()
        #: the worker that keeps the samples of the scrapes every worker is sent
        self._records = link.index == 0
        self._topic = worker_topic(self._me)

    def _role_tasks(self) -> list[asyncio.Task]:
        return [asyncio.create_task(self._follow(), name="kvroute-feed")]

    def _close(self) -> None:
        if self._push_now is not None:  # a shadow context's socket: destroy does not see it
            self._push_now.close(linger=0)
        self._link = None  # `push_nowait` sends nothing from here on

    def _fallback(self, backend: str, reason: str) -> None:
        """Not counted here: the collector counts the router's downgrades once."""

    def _decoded(self, backend: Backend, sample: tuple[float, float, float]) -> None:
        """Every worker gets the same snapshots: the first keeps their samples in the
        shared table, and each computes the speed again from it."""
        self._fleet.scraped_decode(backend, sample, record=self._records)

    def _source(self, backend: Backend, cfg: KvEventsConfig, index: TieredIndex) -> Held:
        """The applier of the batches the collector forwards for `backend` to this worker's
        own index (none come where the collector's index is every worker's: feed.py `h`)."""
        return applier(backend, index, self._fleet)

    async def broadcast(self, payload: bytes) -> None:
        """Send `payload` to every worker (this one included) through the collector."""
        if self._push is None:
            self._push = self._context().socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 0)
            self._push.connect(self._link.control)
        async with asyncio.timeout(BROADCAST_TIMEOUT_S):
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

    async def joined(self, timeout: float) -> bool:
        """Wait until the feed is live (True), at most `timeout` seconds."""
        try:
            async with asyncio.timeout(timeout):
                await self._joined.wait()
        except TimeoutError:
            return False
        return True

    async def _follow(self) -> None:
        """Apply what the collector publishes."""
        sub = self._context().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, FEED_HWM)
        for topic in (*FOLLOWED, self._topic):
            sub.setsockopt(zmq.SUBSCRIBE, topic)  # not the other workers' welcomes
        sub.connect(self._link.feed)
        queued = zmq.Socket.shadow(sub.underlying)  # reads what waits, no future per message
        hello = asyncio.create_task(self._hello())
        try:
            while True:
                messages = [await sub.recv_multipart(), *drain(queued, _DRAIN)]
                for frames in messages:
                    self._apply(frames)
                if len(messages) > _DRAIN:  # more may wait: requests get their turn first
                    await asyncio.sleep(0)
        finally:
            hello.cancel()
            sub.close()

    def _apply(self, frames: list[bytes]) -> None:
        """One feed message applied; one this worker cannot apply (a collector of another
        release, a payload it cannot read) is skipped and said, so the feed goes on."""
        try:
            kind, name, *rest = frames
            self._received(kind, name.decode(), rest)
        except Exception as exc:  # the feed must outlive any one message
            _skipped.warning("a feed message (%r) was skipped: %r", frames[0][:16], exc)
            self._metrics.feed_skipped.labels("feed").inc()

    async def _hello(self) -> None:
        """Say hello to the collector until its answer comes back on the feed."""
        while not self._joined.is_set():
            with contextlib.suppress(TimeoutError):  # the collector is not up yet
                await self.broadcast(HELLO + self._me)
            await asyncio.sleep(HELLO_INTERVAL_S)

    def _received(self, kind: bytes, name: str, rest: list[bytes]) -> None:
        if kind == b"s":
            for backend_name, snap in _SNAPSHOTS.decode(rest[0]):
                backend = self._fleet.find(backend_name)
                if backend is not None:
                    self._scraper.keep(backend, snap)
        elif kind == b"k" and name in self._upkeep.held:
            self._upkeep.held[name][0].apply_payloads(rest)
        elif kind == b"h":
            self._heard(rest[0])
        elif kind == b"c" and (index := self._upkeep.index) is not None:
            index.cleared(name)
            log.backends.warning("KV index of %s cleared (collector's reset)", name)
        elif kind == b"l":
            self._learned(rest[0])
        elif kind == b"r":
            apply_remote_load(self._fleet, rest[0])
        elif kind == b"v":
            apply_shared_speeds(self._fleet, rest[0])
        elif kind == b"a":
            self._on_broadcast(rest[0])
        elif kind == b"p":
            self._verdicts.adopt(rest[0])
        elif kind == self._topic:
            self._welcomed(name, rest)

    def _welcomed(self, what: str, rest: list[bytes]) -> None:
        """What the collector sent this worker alone (collector_feed.py `_welcome`)."""
        if what == "j":  # nothing published from here on is missed
            self._joined.set()
        elif what == "e":
            self._on_broadcast(rest[0])
        elif what == "l":
            self._learned(rest[0])
        elif what == "r":
            apply_remote_load(self._fleet, rest[0])
        elif what == "v":
            apply_shared_speeds(self._fleet, rest[0])
        elif what == "i" and (index := getattr(self._fleet.policy, "index", None)) is not None:
            index.restore(rest[0].decode(), msgspec.msgpack.decode(rest[1]))

    def _heard(self, payload: bytes) -> None:
        """Which backends' KV events the collector applied to the shared index lately,
        and when each published its last (feed.py `h`)."""
        index = getattr(self._fleet.policy, "index", None)
        if index is None:
            return
        for name, (at, published) in _HEARD.decode(payload).items():
            index.trust.heard[name] = at
            if published is not None:
                index.published[name] = published

    def _learned(self, payload: bytes) -> None:
        """Another worker's placements, into this worker's index for their whole TTL, and
        the answers it saw, correcting it (hashing/cache_trust.py). Where the workers share
        the index only the other replicas' placements (sent as the collector's) are new to
        it, and the answers come as what they teach."""
        batch = decode_learned(payload)
        index = getattr(self._fleet.policy, "index", None)
        if index is None or batch.worker == self._link.index:
            return
        if batch.worker == COLLECTOR or not index.shared:  # else in the shared index
            for backend, expires_at, keys in batch.placed:
                index.gpu.learn(backend, keys, expires_at)
        for answer in batch.answers:
            self._feedback.adopt(answer)
        for lesson in batch.lessons:
            self._feedback.learn(lesson)
