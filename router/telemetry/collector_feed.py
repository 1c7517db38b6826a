"""The collector's telemetry: it watches the backends once and feeds every worker.

Besides scraping and subscribing like a router alone, it publishes what it learns on
the feed (router/telemetry/feed.py: snapshots, KV batches in order, index resets,
verdicts, edits), relays what workers push to its control socket (placements, refused
connections, admin edits, hellos), and welcomes each joining worker with what it
missed. With `cluster` set it also holds the replica's link to the other replicas
(router/telemetry/cluster.py): the workers' placements go out there too, and what the
others send comes to the workers as placements (`l`) and load (`r`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import msgspec
import zmq

from hashing.tiered_index import TieredIndex
from router import log
from router.config import KvEventsConfig
from router.context import WorkerContext
from router.fleet.backends import Backend
from router.fleet.health import REFUSED, Verdicts
from router.fleet.placements import LEARNED
from router.telemetry.cluster import ClusterLink
from router.telemetry.feed import (
    FEED_HWM,
    HEARD_INTERVAL_S,
    HELLO,
    SNAPSHOTS_INTERVAL_S,
    worker_topic,
)
from router.telemetry.index_upkeep import Held, Sink, subscribe
from router.telemetry.kv_events import EventApplier
from router.telemetry.loops import Parts, Telemetry
from router.telemetry.scrape import VllmSnapshot

#: control messages the collector could not apply
_skipped = log.Throttled(log.server, burst=5, window=60.0)


class _Forwarder:
    """The collector's EventApplier: in-order batches go to the workers (`publish`; None
    when they share the collector's index), and to the collector's own index (the
    snapshot a late worker starts from, or the host's)."""

    def __init__(
        self,
        applier: EventApplier,
        backend: str,
        publish: Callable[[list[bytes]], None] | None,
    ) -> None:
        self._applier = applier
        self._name = backend.encode()
        self._publish = publish
        self.stats = applier.stats

    def apply_payload(self, payload: bytes) -> None:
        self.apply_payloads((payload,))

    def apply_payloads(self, payloads: Sequence[bytes]) -> None:
        """Batches in order: one message to the workers, then this index."""
        if payloads:
            if self._publish is not None:
                self._publish([b"k", self._name, *payloads])
            self._applier.apply_payloads(payloads)


class CollectorTelemetry(Telemetry):
    def __init__(
        self,
        parts: Parts,
        link: WorkerContext,
        on_broadcast: Callable[[bytes], None],
        verdicts: Verdicts,
        replay: Callable[[], list[bytes]],
        cluster: ClusterLink | None = None,
    ) -> None:
        super().__init__(parts)
        self._cluster = cluster
        self._link = link
        self._on_broadcast = on_broadcast
        self._verdicts = verdicts
        self._replay = replay  # the edits that bring a joining worker up to date
        #: each backend's snapshot scraped since the last sent (`_send_snapshots`)
        self._snapshots: dict[str, VllmSnapshot] = {}
        self._verdicts_ready = False  # its first probe round is done
        # a plain socket: sends never wait, so none needs a future (closed in `_close`)
        self._pub = zmq.Context.shadow(self._context().underlying).socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, FEED_HWM)
        self._pub.bind(link.feed)
        if cluster is not None:
            cluster.attach(self._publish)

    def _role_tasks(self) -> list[asyncio.Task]:
        tasks = [
            asyncio.create_task(self._relay(), name="kvroute-control"),
            asyncio.create_task(self._heard(), name="kvroute-heard"),
            asyncio.create_task(self._send_snapshots(), name="kvroute-snapshots"),
        ]
        if self._cluster is not None:
            tasks.append(asyncio.create_task(self._cluster.run(), name="kvroute-cluster"))
        return tasks

    def _close(self) -> None:
        self._pub.close(linger=0)

    def _publish(self, frames: list[bytes]) -> None:
        """Never blocks: a worker too slow to keep up loses messages, not the collector."""
        self._pub.send_multipart(frames, flags=zmq.NOBLOCK)

    def _scraped(self, backend: str, snap: VllmSnapshot) -> None:
        """Sent with the others of its `SNAPSHOTS_INTERVAL_S` (`_send_snapshots`)."""
        self._snapshots[backend] = snap

    async def _send_snapshots(self) -> None:
        """Every `SNAPSHOTS_INTERVAL_S`, the snapshots scraped since, in one message."""
        while True:
            await asyncio.sleep(SNAPSHOTS_INTERVAL_S)
            if self._snapshots:
                batch, self._snapshots = self._snapshots, {}
                self._publish([b"s", b"", msgspec.msgpack.encode(list(batch.items()))])

    def _decoded(self, backend: Backend, sample: tuple[float, float, float]) -> None:
        """Speeds are the workers' to learn (the snapshot goes to them)."""

    def sink(self, applier: EventApplier, backend: str) -> Sink:
        """A subscription's batches: to the workers (unless they share this index),
        then to this index."""
        return _Forwarder(applier, backend, None if self._link.shared_index else self._publish)

    async def _heard(self) -> None:
        """Every `HEARD_INTERVAL_S`, the applied events counted since go to the metric,
        and, over a shared index, the workers hear the backends whose KV events this
        process applied since the last time, with when each published its last: what a
        worker's cache feedback and /debug/routing read of them."""
        sent: dict[str, float] = {}
        while True:
            await asyncio.sleep(HEARD_INTERVAL_S)
            self._metrics.flush_kv_events()
            index = getattr(self._fleet.policy, "index", None)
            if index is None or not self._link.shared_index:
                continue
            news = {
                name: (at, index.published.get(name))
                for name, at in index.trust.heard.items()
                if sent.get(name) != at
            }
            if news:
                sent.update((name, at) for name, (at, _) in news.items())
                self._publish([b"h", b"", msgspec.msgpack.encode(news)])

    def cleared(self, backend: str) -> None:
        """A subscription's index reset: the workers clear their copies too (a shared
        index is the one just cleared)."""
        if not self._link.shared_index:
            self._publish([b"c", backend.encode()])

    def _source(self, backend: Backend, cfg: KvEventsConfig, index: TieredIndex) -> Held:
        """The backend's KV events, subscribed to here and relayed to the workers."""
        fleet, tally = self._fleet, self._metrics.kv_events_applied
        return subscribe(self._context(), fleet, backend, cfg, index, self._fallback, self, tally)

    def publish_verdicts(self) -> None:
        """Send the health verdicts and model lists to every worker."""
        self._verdicts_ready = True
        self._publish([b"p", b"", self._verdicts.encode()])

    def verdicts_changed(self) -> None:
        """Publish the verdicts again, once the first probe round is done (e.g. backends
        a reload or edit added joined with their admission check)."""
        if self._verdicts_ready:
            self.publish_verdicts()

    def announce(self, payload: bytes) -> None:
        """An edit of the collector's own (the discovered backends) to every worker."""
        self._publish([b"a", b"", payload])

    async def _relay(self) -> None:
        """What workers push to the control socket goes to every worker.

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
                    if self._cluster is not None:
                        self._cluster.placed(payload)
                elif payload.startswith(REFUSED):  # nothing listens: down for every worker
                    if self._verdicts.refused(payload):
                        self.verdicts_changed()
                elif payload.startswith(HELLO):
                    await self._welcome(worker_topic(payload[len(HELLO) :]))
                else:
                    self._publish([b"a", b"", payload])
                    self._edit(payload)
        finally:
            pull.close()

    def _edit(self, payload: bytes) -> None:
        """A worker's edit, applied here too; one this process cannot read is skipped and
        said, so the relay goes on (a dead relay would welcome no worker again)."""
        try:
            self._on_broadcast(payload)
        except Exception as exc:
            _skipped.warning("an edit on the control socket was skipped: %r", exc)
            self._metrics.feed_skipped.labels("control").inc()

    async def _welcome(self, topic: bytes) -> None:
        """The answer to a worker's hello, on that worker's topic: `j` (its feed is
        live), the runtime edits the file does not know (`e`), the other replicas'
        live placements and load (`l`, `r`), the index of every
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
        if self._cluster is not None:
            for kind, payload in self._cluster.replay():
                self._publish([topic, kind, payload])
        self.verdicts_changed()
        index = self._upkeep.index
        if index is not None:
            for name in list(self._upkeep.held):
                pairs = msgspec.msgpack.encode(index.snapshot(name))
                self._publish([topic, b"i", name.encode(), pairs])
                await asyncio.sleep(0)
