"""When the fleet is full: each backend's room for more requests, and the fleet's.

A backend has no room when its `vllm:kv_cache_usage_perc` reaches `max_kv_cache_usage`.
Once its batch's limit is learned (router/fleet/batch_limit.py), its room is that limit
plus `max_waiting`, less the router's requests in flight there (exact and current) and
the others its last scrape found there (another replica's, another client's). Before
that, it has none when its queue passes `max_waiting`: the scraped
`vllm:num_requests_waiting`, plus the router's requests sent there since that scrape
whose answer has not begun (no first token yet), and room without bound otherwise (a
vLLM server batches dozens of sequences, and guessing it full would hold requests for
nothing). A scrape is up to an interval old: counting only the requests sent after it
onto a queue it found lets every backend that showed none take every pick until the
next one, which near capacity bursts picks onto the few that showed room; counting them
until their answer begins tracks the queue between scrapes, and lets a held request go
as soon as answers begin there. A backend without a fresh scrape has room without
bound. One scrape that catches a request between two engine steps would judge a
backend full that is not; the next one clears it.

Admission (admission.py) asks the fleet's room before releasing a waiter, and keeps the
last `reserve` of the fleet's learned slots for requests of tenants under their share (a
quiet tenant beside a backlogged one, flow.py). Cost: one pass over the usable backends
that stops as soon as the room asked for is found; the fleet's slots are recounted once
a second.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from router.config import SaturationConfig
from router.fleet.backend import Backend

#: how long the count of the fleet's slots is reused, seconds
_RECOUNT_SECONDS = 1.0


def room_at(backend: Backend, cfg: SaturationConfig, probe: bool = False) -> float:
    """Requests `backend` takes before it is saturated (math.inf: no known bound);
    `probe`: with the slots tried past its limit (batch_limit.py), which only a backlog
    may take."""
    if backend.kv_usage >= cfg.max_kv_cache_usage:
        return 0
    batch = backend.batch
    slots = batch.slots
    if slots is None:
        since = backend.unstarted_at_scrape
        if since is None:  # no fresh scrape: nothing is known of its queue
            return math.inf
        added = max(0, backend.unstarted - since)
        return 0 if backend.waiting + added > cfg.max_waiting else math.inf
    slots += batch.probe if probe else 0
    return max(0, slots + cfg.max_waiting - backend.inflight - batch.others)


def saturated(backend: Backend, cfg: SaturationConfig) -> bool:
    """Is `backend` full by its own state: vLLM's queue or KV cache, or the router's
    requests in flight there against its learned batch limit?"""
    return room_at(backend, cfg) <= 0


class Room(Protocol):
    """The fleet's room for more requests, as admission asks it (`FleetRoom`)."""

    def free(self, enough: float = 1, probe: bool = False) -> float: ...

    def full(self) -> bool: ...

    def reserve(self) -> int: ...

    def slots(self) -> int: ...


class Unbounded:
    """A fleet whose room is never counted (no fleet, as in admission's own tests):
    only the caps hold requests back."""

    def free(self, enough: float = 1, probe: bool = False) -> float:
        return math.inf

    def full(self) -> bool:
        return False

    def reserve(self) -> int:
        return 0

    def slots(self) -> int:
        return 0


class FleetRoom:
    """The fleet's room for more requests, as admission asks it."""

    def __init__(
        self, members: Callable[[], Iterable[Backend]], cfg: Callable[[], SaturationConfig]
    ) -> None:
        """`members`: the fleet's backends now; `cfg`: the saturation settings now."""
        self._members, self._cfg = members, cfg
        self._slots, self._counted = 0, -math.inf

    def free(self, enough: float = 1, probe: bool = False) -> float:
        """The requests the usable backends take before every one is saturated, counted
        up to `enough` at least (math.inf when saturation is off, or some backend's
        bound is unknown, or none is usable: routing then answers); `probe`: with
        the slots tried past the backends' limits."""
        cfg = self._cfg()
        if not cfg.enabled:
            return math.inf
        total, seen = 0.0, False
        for backend in self._members():
            if backend.usable:
                seen = True
                total += room_at(backend, cfg, probe)
                if total >= enough:
                    return total
        return total if seen else math.inf

    def full(self) -> bool:
        """Is every usable backend saturated (and is there one)? Then requests wait."""
        return self.free() <= 0

    def slots(self) -> int:
        """The usable backends' learned batch slots (recounted once a second, and
        while none is known)."""
        now = time.monotonic()
        if not self._slots or now - self._counted >= _RECOUNT_SECONDS:
            self._slots = sum(b.batch.slots or 0 for b in self._members() if b.usable)
            self._counted = now
        return self._slots

    def reserve(self) -> int:
        """The slots kept for requests of tenants under their share (flow.py):
        `reserve` of the learned batch slots."""
        return math.ceil(self._cfg().reserve * self.slots())
