"""The KV-aware policy's prefix index, kept in step with the fleet beside the path.

Once a second `IndexUpkeep` makes the index's event sources follow the current config
(reloads add, drop or re-point them, and a reload that built a new policy starts them
all anew), ages the index, and sizes it to each backend's scraped block count. What a
source is depends on the process (`Source`): a KV event subscription of its own
(`subscribe`), or, in a worker of several, an applier of the batches the collector
forwards.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import zmq.asyncio

from hashing.tiered_index import TieredIndex
from router import log
from router.config import KvEventsConfig
from router.fleet.backends import Backend, Fleet
from router.metrics import Metrics
from router.telemetry.kv_events import EventApplier, EventSubscriber, Tally, run_forever
from router.telemetry.scrape import VllmSnapshot

Held = asyncio.Task | EventApplier
#: a backend's event source: (backend, its endpoints, the index) -> what is held for it
Source = Callable[[Backend, KvEventsConfig, TieredIndex], Held]


class Sink(Protocol):
    def apply_payload(self, payload: bytes) -> None: ...

    def apply_payloads(self, payloads: Sequence[bytes]) -> None: ...


class Relay(Protocol):
    """Where a subscription's batches and resets go besides the index (the collector's
    feed to the workers)."""

    def sink(self, applier: EventApplier, backend: str) -> Sink: ...

    def cleared(self, backend: str) -> None: ...


def applier(
    backend: Backend,
    index: TieredIndex,
    fleet: Fleet,
    tally: Tally | None = None,
) -> EventApplier:
    """What turns the backend's event batches into index updates."""
    block_size = fleet.policy.params.block_size
    base_model = functools.partial(_base_model, backend)  # read at each batch
    return EventApplier(backend.name, index, block_size, base_model, tally)


def subscribe(
    context: zmq.asyncio.Context,
    fleet: Fleet,
    backend: Backend,
    cfg: KvEventsConfig,
    index: TieredIndex,
    fallback: Callable[[str, str], None],
    relay: Relay | None,
    tally: Tally | None = None,
) -> asyncio.Task:
    """A task following the backend's KV events into `index` (and `relay`), counted by
    `tally`."""
    events = applier(backend, index, fleet, tally)
    sink = events if relay is None else relay.sink(events, backend.name)

    def reset(why: str) -> None:
        index.cleared(backend.name)
        if relay is not None:
            relay.cleared(backend.name)
        fallback(backend.name, "event_reset")
        log.backends.warning("KV index of %s cleared: %s", backend.name, why)

    sub = EventSubscriber(context, sink, cfg.endpoint, cfg.replay_endpoint, cfg.topic, reset)
    return asyncio.create_task(run_forever(sub, backend.name), name=f"kvroute-kv-{backend.name}")


def _base_model(backend: Backend) -> str:
    """The backend's served base model: the root of the event chains that carry no LoRA."""
    for card in backend.model_cards:
        if not card.get("parent"):
            return str(card.get("id", ""))
    return next(iter(sorted(backend.configured_models or ())), "")


def cache_blocks(snap: VllmSnapshot, block: int) -> int:
    """A backend's KV cache in the index's blocks of `block` tokens: its GPU blocks of
    its own size (vLLM's cache_config_info), taken to be the index's where not given."""
    return max(1, (snap.num_gpu_blocks or 0) * (snap.block_size or block) // block)


class IndexUpkeep:
    def __init__(
        self,
        fleet: Fleet,
        metrics: Metrics,
        kv_events: Callable[[], dict[str, KvEventsConfig]],
        snapshots: dict[str, VllmSnapshot],
        source: Source,
        counts_shared: bool,
    ) -> None:
        """`counts_shared`: this process shows the size of an index every process maps
        (the collector's, or a process alone's), so the gauge's sum counts it once."""
        self._fleet = fleet
        self._counts_shared = counts_shared
        #: the index's writes cut short for want of room, when last looked at
        self._cut_short = 0
        self._metrics = metrics
        self._kv_events = kv_events
        self._snapshots = snapshots
        self._source = source
        #: per backend with events: what its source holds, and the endpoints it was made for
        self.held: dict[str, tuple[Held, KvEventsConfig]] = {}
        self.index: TieredIndex | None = None

    async def run(self) -> None:
        """Once a second: sources follow membership, the index ages and resizes, and
        its memory is shown."""
        while True:
            index = getattr(self._fleet.policy, "index", None)
            if index is not None:
                self._sync(index)
                index.gpu.expire(time.monotonic())
                self._metrics.index_bytes(index.nbytes(self._counts_shared))
                self._metrics.flush_kv_events()
                self._warn_if_full(index)
                block = self._fleet.policy.params.block_size
                for name, snap in self._snapshots.items():
                    if snap.num_gpu_blocks:
                        index.gpu.set_capacity(name, cache_blocks(snap, block))
            await asyncio.sleep(1.0)

    def _warn_if_full(self, index: TieredIndex) -> None:
        """Say so (at most once a pass) when the shared index's file system ran out of
        room: the index keeps what fits, and the run directory needs more."""
        cut = index.cut_short()
        if cut > self._cut_short and self._counts_shared:
            log.server.warning(
                "the prefix index's run directory is full: %d writes kept only what fit "
                "(give /dev/shm more room, e.g. docker run --shm-size)",
                cut - self._cut_short,
            )
        self._cut_short = cut

    def tasks(self) -> list[asyncio.Task]:
        """The subscription tasks held (to cancel them at stop)."""
        return [held for held, _ in self.held.values() if isinstance(held, asyncio.Task)]

    def _sync(self, index: TieredIndex) -> None:
        """Sources follow the current config: reloads add, drop or re-point them."""
        endpoints = self._kv_events()
        wanted = {b.name: b for b in self._fleet.members if b.name in endpoints}
        fresh_index = index is not self.index  # a reload built a new policy
        self.index = index
        for name, (held, cfg) in list(self.held.items()):
            if fresh_index or name not in wanted or endpoints[name] != cfg:
                if isinstance(held, asyncio.Task):
                    held.cancel()
                del self.held[name]
        for name, backend in wanted.items():
            if name not in self.held:
                self.held[name] = (self._source(backend, endpoints[name], index), endpoints[name])
        events = self._fleet.policy.event_backends  # a pool's tuned twin shares the set
        events.clear()
        events.update(self.held)
        for backend in self._fleet.members:
            self._metrics.index_mode(backend.name, backend.name in self.held)
