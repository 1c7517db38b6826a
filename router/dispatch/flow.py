"""Flow control: the order in which waiting requests are released, and when to wait.

Admission (router/dispatch/waiting.py) keeps its waiters here instead of one FIFO:

- **Classes.** `critical`, `standard` (the default), `sheddable`, and `background`
  (async jobs and batch lines, router/jobs/execute.py): a request waiting in
  a higher class is always released before any in a lower one. A request waiting longer
  than its class's `max_wait` is released as if of the class above, so nothing starves.
  When the queue is full, a newcomer takes the place of the newest waiter of a lower
  class, which is refused `shed`: `sheddable` absorbs the refusals first.
- **Fair share.** Within a class, each tenant has its own FIFO, and the tenants take
  turns by deficit round robin: each turn a tenant is credited its weight and releases
  one request per whole credit. A tenant sending five times its share therefore only
  lengthens its own queue. Weights come from `flow.tenants`, else `default_weight`.
- **Class of a request.** Its tenant's `priority` (else its static token's, else
  `standard`), or the `priority_header` when the request names one: any tenant may lower
  its class, only a `trusted` one (tenant or token) raise it. An
  untrusted tenant naming a higher class is refused (403, not silently lowered, so a
  misconfigured client learns it at once).
- **The reserve.** While requests of a tenant under its fair share come beside other
  flows' waiters, the fleet's last slots (saturation.py) go only to those: to a tenant
  with fewer requests here (in flight and waiting) than twice its weight's share of the
  fleet's learned batch slots (shares.py), or to a class above the lowest one waiting.
  As many are kept as find one free for 99.8% of such requests at their arrival rate
  against the fleet's completion rate (`reserve_for`), at most `saturation.reserve` of
  the fleet's slots. Such a request also goes at once, past other tenants' waiters,
  while the fleet has room. A quiet tenant beside a backlogged one therefore rarely
  waits at all, and a tenant alone is never held back by the reserve (one with a
  backlog past the fleet's slots is over its share, one with less may take it).
- **Saturation** (saturation.py): while no usable backend has room, no waiter is
  released: requests wait in the router, in the order above, not in vLLM's queue; they
  are released (then routed as usual, cache-aware) as backends gain room.

Scope: the queue is per worker process; the counts the caps check are router-wide
(shared_admission.py), and so are the numbers of waiters per class: a worker releases
its own best waiter only while no other worker has a waiter of a higher class, so the
class order holds router-wide (within a 10 ms poll), and a waiter past its `max_wait`
goes first whatever waits in other workers. So does the reserve: a tenant's
share counts its requests in every worker, and the reserve is kept for the requests
wanting it in any worker, at the router's completion rate (signals.py). The round robin
between tenants holds within each worker's queue (a tenant's requests spread over the
workers take turns in each). The saturation gate is the same for all
(every worker counts every worker's requests in flight). Across replicas each keeps its
own queue, shares and reserve: each replica's fair share is of its own traffic, against
the whole fleet's slots.
Cost: O(1) per release (amortized over the round-robin ring), O(tenants waiting) for
a release into the reserve, O(queue) only for a waiter that gives up or is shed.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from multidict import CIMultiDict

from router.config import PRIORITIES, FlowConfig, LimitsConfig, TokenClass
from router.dispatch.signals import LEFT, FlowCells, Rate
from router.errors import KvrouteError

DEFAULT_CLASS = "standard"
#: async jobs' and batch lines' class, below every interactive one
BACKGROUND = "background"
_RANK = {name: rank for rank, name in enumerate(PRIORITIES)}
#: how often a request that may take the reserve may find it taken: well under 1%, or
#: those that do set its P99 (one wait in 500 leaves a P99 a margin of five)
RESERVE_MISS = 0.002


class PriorityRefused(KvrouteError):
    """A class the tenant may not ask for."""

    status = 403


@dataclass(eq=False)
class Waiter:
    """One request waiting for a slot."""

    tenant: str
    rank: int
    future: asyncio.Future[None]
    since: float = field(default_factory=time.monotonic)
    #: its tenant as the metrics label it
    label: str = ""


def request_class(
    flow: FlowConfig,
    tenant: str | None,
    headers: CIMultiDict[str] | None,
    token: TokenClass | None = None,
) -> str:
    """The class of a request: its tenant's config's, else its token's, or the header's
    when that is allowed."""
    cfg = flow.tenants.get(tenant or "")
    if cfg is not None:
        own, trusted = cfg.priority, cfg.trusted
    elif token is not None:
        own, trusted = token.priority, token.trusted
    else:
        own, trusted = DEFAULT_CLASS, False
    asked = headers.get(flow.priority_header) if headers and flow.priority_header else None
    if asked is None:
        return own
    asked = asked.strip().lower()
    if asked not in _RANK:
        raise PriorityRefused(
            f"Unknown priority `{asked[:32]}`; one of {', '.join(PRIORITIES)}.",
            param=flow.priority_header,
            status=400,
        )
    if _RANK[asked] < _RANK[own] and not trusted:
        raise PriorityRefused(
            f"Priority `{asked}` is above this tenant's (`{own}`); only a trusted tenant "
            "may raise it.",
            param=flow.priority_header,
        )
    return asked


def decision(reason: str, queued: float) -> str:
    """The answer's x-kvroute-reason: why its backend was picked, then `queued` when the
    request waited in the router's queue (`queued` seconds) before that pick."""
    parts = [reason] if reason else []
    if queued:
        parts.append("queued")
    return "; ".join(parts)


def rank_of(name: str) -> int:
    return _RANK[name]


class FairQueue:
    """One class's waiters: a FIFO per tenant, released by deficit round robin."""

    def __init__(self, weights: dict[str, float], default_weight: float) -> None:
        self._weights, self._default = weights, default_weight
        self._queues: dict[str, deque[Waiter]] = {}
        self._credit: dict[str, float] = {}
        self._ring: deque[str] = deque()  # the tenants with waiters, whose turn first
        self._visiting: str | None = None  # the tenant whose turn it is, credited
        self.size = 0

    def reweigh(self, weights: dict[str, float], default_weight: float) -> None:
        self._weights, self._default = weights, default_weight

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, self._default)

    def push(self, waiter: Waiter) -> None:
        queue = self._queues.get(waiter.tenant)
        if queue is None:
            queue = self._queues[waiter.tenant] = deque()
            self._credit[waiter.tenant] = 0.0
            self._ring.append(waiter.tenant)
        queue.append(waiter)
        self.size += 1

    def pop(self) -> Waiter:
        """The next waiter by weighted turns (the queue is not empty)."""
        ring, credit = self._ring, self._credit
        while True:
            tenant = ring[0]
            if tenant != self._visiting:  # its turn begins: credit its weight
                credit[tenant] += self.weight(tenant)
                self._visiting = tenant
            if credit[tenant] >= 1:
                credit[tenant] -= 1
                return self._take(tenant, self._queues[tenant].popleft())
            ring.rotate(-1)
            self._visiting = None

    def waits(self, tenant: str) -> bool:
        """Has `tenant` a waiter here?"""
        return tenant in self._queues

    def first_of(self, chosen: Callable[[str], bool]) -> Waiter | None:
        """The longest waiting at the head of a `chosen` tenant's FIFO."""
        heads = (q[0] for tenant, q in self._queues.items() if chosen(tenant))
        return min(heads, key=_since, default=None)

    def oldest(self) -> Waiter | None:
        """The longest waiting (each tenant's FIFO is in arrival order)."""
        return min((q[0] for q in self._queues.values()), key=_since, default=None)

    def newest(self) -> Waiter | None:
        return max((q[-1] for q in self._queues.values()), key=_since, default=None)

    def remove(self, waiter: Waiter) -> bool:
        queue = self._queues.get(waiter.tenant)
        if queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        self._take(waiter.tenant, waiter)
        return True

    def _take(self, tenant: str, waiter: Waiter) -> Waiter:
        self.size -= 1
        if not self._queues[tenant]:  # an idle tenant keeps no credit (DRR)
            del self._queues[tenant], self._credit[tenant]
            self._ring.remove(tenant)
        return waiter


def _since(waiter: Waiter) -> float:
    return waiter.since


class FlowQueue:
    """Every class's waiters of one worker, released highest class first."""

    def __init__(self, flow: FlowConfig, limits: LimitsConfig) -> None:
        self._classes = [FairQueue({}, flow.default_weight) for _ in PRIORITIES]
        self.configure(flow, limits)

    def configure(self, flow: FlowConfig, limits: LimitsConfig) -> None:
        """New settings (reload); waiters keep their place."""
        self.flow, self.limits = flow, limits
        self._max_wait = [self._of(name, "max_wait") for name in PRIORITIES]
        weights = {name: t.weight for name, t in flow.tenants.items() if t.weight}
        for fair in self._classes:
            fair.reweigh(weights, flow.default_weight)

    def _of(self, name: str, key: str) -> float | None:
        cfg = self.flow.classes.get(name)  # type: ignore[call-overload]
        value = getattr(cfg, key) if cfg is not None else None
        return getattr(self.limits, key, None) if value is None else value

    def queue_size(self, name: str) -> int:
        return self._of(name, "queue_size")  # type: ignore[return-value]

    def queue_timeout(self, name: str) -> float:
        return self._of(name, "queue_timeout")  # type: ignore[return-value]

    def __len__(self) -> int:
        return sum(fair.size for fair in self._classes)

    def depth(self, rank: int) -> int:
        return self._classes[rank].size

    def top_rank(self) -> int:
        """The highest class with waiters (the queue is not empty)."""
        return next(rank for rank, fair in enumerate(self._classes) if fair.size)

    def push(self, waiter: Waiter) -> None:
        self._classes[waiter.rank].push(waiter)

    def remove(self, waiter: Waiter) -> bool:
        return self._classes[waiter.rank].remove(waiter)

    def pop(self) -> Waiter | None:
        """The next to release: a waiter past its class's `max_wait` (oldest first),
        else the highest class's next by fair share."""
        overdue = self._overdue()
        if overdue is not None:
            self._classes[overdue.rank].remove(overdue)
            return overdue
        for fair in self._classes:
            if fair.size:
                return fair.pop()
        return None

    def release_rank(self) -> int:
        """The class the next release competes as against other workers' waiters: the
        highest with waiters here, or the top one when a waiter is past its `max_wait`
        (`pop` releases it first, before any class: so nothing starves behind another
        worker's higher classes either). The queue is not empty."""
        return 0 if self._overdue() is not None else self.top_rank()

    def _overdue(self) -> Waiter | None:
        """The oldest waiter past its class's `max_wait`, of the highest such class."""
        now = time.monotonic()
        for rank in range(1, len(self._classes)):
            max_wait = self._max_wait[rank]
            oldest = self._classes[rank].oldest() if max_wait is not None else None
            if oldest is not None and now - oldest.since >= max_wait:
                return oldest
        return None

    def pop_reserved(self, under_share: Callable[[str], bool]) -> Waiter | None:
        """The next to release into the reserve: in the highest class with waiters, its
        next by fair share when a lower class waits too, else the longest waiting of
        the tenants `under_share` (None if there is none)."""
        top = self.top_rank()
        fair = self._classes[top]
        if self.waits_below(top):
            return fair.pop()
        waiter = fair.first_of(under_share)
        if waiter is not None:
            fair.remove(waiter)
        return waiter

    def weight(self, tenant: str) -> float:
        return self._classes[0].weight(tenant)

    def waits(self, tenant: str, rank: int) -> bool:
        """Has the flow of `tenant` in class `rank` a waiter here?"""
        return self._classes[rank].waits(tenant)

    def waits_above(self, rank: int) -> bool:
        """Has a class above `rank` a waiter here?"""
        return any(fair.size for fair in self._classes[:rank])

    def waits_below(self, rank: int) -> bool:
        """Has a class below `rank` a waiter here?"""
        return any(fair.size for fair in self._classes[rank + 1 :])

    def lower_than(self, rank: int) -> Waiter | None:
        """The newest waiter of the lowest class below `rank`: the one shed for it."""
        for lower in range(len(self._classes) - 1, rank, -1):
            newest = self._classes[lower].newest()
            if newest is not None:
                return newest
        return None


class DrainRate(Rate):
    """Requests leaving per second: this worker's is what Retry-After is computed from
    (its own waiters drain at its own rate), the router's what the reserve is sized by."""

    __slots__ = ()

    def __init__(self, cells: FlowCells | None = None) -> None:
        super().__init__(cells, LEFT)

    def left(self) -> None:
        self.count()

    def retry_after(self, queued: int) -> int:
        """Seconds until `queued` waiters and one more are likely through, 1..60."""
        rate = self.per_second()
        if rate <= 0:
            return 1
        return max(1, min(60, math.ceil((queued + 1) / rate)))


def reserve_for(arrivals: float, completions: float, most: int) -> int:
    """The slots to keep so that requests arriving at `arrivals` a second, each taking a
    kept slot that the next of `completions` a second gives back, find one free
    `1 - RESERVE_MISS` of the time: k with (arrivals / completions) ** k below
    `RESERVE_MISS` (the kept slots taken are a birth-death chain), at least one and at
    most `most`."""
    if arrivals <= 0:
        return min(1, most)
    if completions <= arrivals:
        return most
    k = math.ceil(math.log(RESERVE_MISS) / math.log(arrivals / completions))
    return max(1, min(most, k))
