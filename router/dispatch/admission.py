"""Admission: a router-wide concurrency limit with a wait queue, and per-tenant caps.

`enter` admits a request at once while fewer than `max_concurrent_requests` are active
and some backend is not saturated; otherwise it waits in the queue of router/dispatch/
flow.py (classes, fair share between tenants) for up to its class's `queue_timeout`.
A full queue, a wait that times out, or a waiter shed for a higher class is a 503 with
`Retry-After` (from the drain rate) and `x-kvroute-drop-reason`, so a burst is smoothed
instead of refused and an overload is refused fast instead of piling up. A tenant at
`max_concurrent_per_tenant` (admitted and queued together) is refused at once with a
429: one tenant can never fill the queue.

The counts both caps are checked against are `Counts`: this process's own (a router
of one process), or with several workers the shared admission table
(router/dispatch/shared_admission.py), so both caps hold for the whole router, and so
does the class order (each worker publishes its waiters per class there). The queue
stays per worker (`queue_size` waiters in each): a slot freed in this worker goes
straight to its next waiter unless another worker has a waiter of a higher class; one
freed in another worker, or a backend leaving saturation, is found by a poll every
`_POLL_SECONDS`, armed only while this worker has waiters.

Invariants: `active` counts this worker's admitted requests exactly, as the counts'
total does. A freed slot is handed straight to the next waiter (so the count does
not dip and a newcomer cannot barge past the queue); a waiter that gives up (timeout,
client gone) after its slot was handed over passes it on. `enter` returns what `leave`
must give back, so a reload that changes the caps in between cannot unbalance the
per-tenant counts. Cost: O(1) per request, O(queue) only when a waiter gives up.

Metrics: each refusal by its reason, and the queue's depth (total, by class and by
tenant) and each waiter's wait by class and by tenant, the tenant bounded as every
tenant label is (`metrics.tenants` and the static tokens' by name, else `(other)`),
set only when the queue changes (a request admitted at
once touches no metric here).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from typing import Protocol

from router.config import PRIORITIES, FlowConfig, LimitsConfig
from router.dispatch.flow import DEFAULT_CLASS, DrainRate, FlowQueue, Waiter, rank_of
from router.dispatch.session import SessionRecords
from router.dispatch.shared_admission import TOTAL
from router.errors import Overloaded
from router.metrics import Metrics, Refusal

#: how often a worker with waiters looks for a slot freed in another worker
_POLL_SECONDS = 0.01


class Counts(Protocol):
    """Requests counted per key (TOTAL, or a tenant's key), each against a cap."""

    shared: bool  # other processes change the counts too
    #: the session affinity records shared with the other processes, if any
    sessions: SessionRecords | None

    def key(self, tenant: str) -> Hashable:
        """What `tenant` is counted under."""

    def take(self, key: Hashable, cap: int) -> bool:
        """Count one more under `key` if that stays within `cap`."""

    def give(self, key: Hashable) -> None: ...

    def set_waiting(self, rank: int, depth: int) -> None:
        """This process's waiters of class `rank` now."""

    def waiting_above(self, rank: int) -> bool:
        """Does another process have a waiter of a class above `rank`?"""


class LocalCounts:
    """One process's counts: the whole router's when it is the only worker."""

    shared = False
    sessions = None

    def __init__(self) -> None:
        self._counts: dict[Hashable, int] = {}

    def key(self, tenant: str) -> str:
        return tenant

    def take(self, key: Hashable, cap: int) -> bool:
        count = self._counts.get(key, 0)
        if count >= cap:
            return False
        self._counts[key] = count + 1
        return True

    def give(self, key: Hashable) -> None:
        count = self._counts[key] - 1
        if count:
            self._counts[key] = count
        else:
            del self._counts[key]  # bounded: only keys with requests in flight

    def set_waiting(self, rank: int, depth: int) -> None:
        pass  # no other process to tell

    def waiting_above(self, rank: int) -> bool:
        return False


class Admission:
    def __init__(
        self,
        limits: LimitsConfig,
        counts: Counts | None = None,
        metrics: Metrics | None = None,
        flow: FlowConfig | None = None,
        saturated: Callable[[], bool] = lambda: False,
        tenant_label: Callable[[str | None], str] = lambda tenant: tenant or "",
    ) -> None:
        """`saturated`: whether every backend is full now (flow.py's `all_saturated`),
        when requests wait here instead of in the backends' queues; `tenant_label`: a
        tenant's label in the metrics (bounded)."""
        self.limits = limits
        self.active = 0
        self._counts = counts or LocalCounts()
        self._metrics = metrics
        self._queue = FlowQueue(flow or FlowConfig(), limits)
        self._saturated = saturated
        self._tenant_label = tenant_label
        #: this worker's waiters by tenant label
        self._tenant_depth: dict[str, int] = {}
        self._drain = DrainRate()
        #: saturation held requests back since the queue was last empty: release paced
        self._held_back = False
        self._poll: asyncio.TimerHandle | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def configure(self, limits: LimitsConfig, flow: FlowConfig | None = None) -> None:
        """New limits (reload); waiters that now fit are admitted."""
        self.limits = limits
        self._queue.configure(flow or self._queue.flow, limits)
        self._admit_waiters()

    async def enter(self, tenant: str | None, priority: str = DEFAULT_CLASS) -> Hashable | None:
        """Take a slot (waiting if need be) or raise Overloaded; returns the tenant key held."""
        return (await self.enter_timed(tenant, priority))[0]

    async def enter_timed(
        self, tenant: str | None, priority: str = DEFAULT_CLASS
    ) -> tuple[Hashable | None, float]:
        """`enter`'s tenant key, and the seconds the request waited in the queue (0: it
        was admitted at once)."""
        held = self._take_tenant(tenant)
        try:
            waited = await self._take_slot(tenant or "", rank_of(priority))
        except BaseException:
            self._give_tenant(held)
            raise
        return held, waited

    def leave(self, held: Hashable | None) -> None:
        self._give_tenant(held)
        self._drain.left()
        if not len(self._queue) or self._saturated() or not self._wake():  # else handed over
            self._give_slot()

    def _wake(self) -> bool:
        """Hand a slot to the next live waiter; False if there is none, or if another
        worker has a waiter of a higher class (its poll takes the slot)."""
        queue = self._queue
        while len(queue) and not self._counts.waiting_above(queue.top_rank()):
            waiter = queue.pop()
            self._queue_changed(waiter, -1)
            if not waiter.future.done():  # a cancelled one is queued until its task runs
                waiter.future.set_result(None)
                return True
        return False

    def _admit_waiters(self) -> None:
        """Hand the slots free now to the waiters, in flow order. After the fleet was
        saturated, one per call (each poll, each reload): a released request counts on
        its backend only once its task runs, so releasing a whole backlog at once, the
        moment one backend leaves saturation, would flood that backend's queue."""
        queue = self._queue
        paced = self._held_back
        while len(queue) and not self._counts.waiting_above(queue.top_rank()) and self._free_slot():
            if not self._wake():  # only cancelled ones were left
                self._give_slot()
                return
            if paced:
                break
        if not len(queue):
            self._held_back = False

    def _free_slot(self) -> bool:
        if self._saturated():
            self._held_back = True
            return False
        if not self._counts.take(TOTAL, self.limits.max_concurrent_requests):
            return False
        self.active += 1
        return True

    def _give_slot(self) -> None:
        self.active -= 1
        self._counts.give(TOTAL)

    async def _take_slot(self, tenant: str, rank: int) -> float:
        """Take a slot, waiting in the queue if need be; the seconds waited there."""
        queue = self._queue
        if not len(queue) and not self._counts.waiting_above(rank) and self._free_slot():
            return 0.0
        name = PRIORITIES[rank]
        if queue.depth(rank) >= queue.queue_size(name):
            raise self._refused(Refusal.QUEUE_FULL, f"The `{name}` queue is full.")
        if len(queue) >= self.limits.queue_size:
            victim = queue.lower_than(rank)
            if victim is None:
                raise self._refused(Refusal.QUEUE_FULL, "The router's wait queue is full.")
            queue.remove(victim)
            self._queue_changed(victim, -1)
            victim.future.set_exception(
                self._refused(Refusal.SHED, "Shed for a request of a higher priority.")
            )
        waiter = Waiter(tenant, rank, asyncio.get_running_loop().create_future())
        waiter.label = self._tenant_label(tenant or None)
        queue.push(waiter)
        self._queue_changed(waiter, 1)
        self._poll_soon()
        try:
            async with asyncio.timeout(queue.queue_timeout(name)):
                await waiter.future
        except BaseException as exc:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self.leave(None)  # handed a slot just as we gave up: pass it on
            elif queue.remove(waiter):
                self._queue_changed(waiter, -1)
            if isinstance(exc, TimeoutError):
                if self._saturated():
                    raise self._refused(
                        Refusal.SATURATED, "Every backend is saturated; the wait timed out."
                    ) from None
                raise self._refused(
                    Refusal.QUEUE_TIMEOUT,
                    "The wait in the router's queue timed out.",
                ) from None
            raise
        finally:
            waited = time.monotonic() - waiter.since
            if self._metrics is not None:
                self._metrics.flow_wait.labels(name).observe(waited)
                self._metrics.flow_tenant_wait.labels(waiter.label).observe(waited)
        return waited

    def _poll_soon(self) -> None:
        """Look again soon for a slot another worker freed, or a backend that left
        saturation (neither wakes this worker)."""
        if self._poll is None:
            self._poll = asyncio.get_running_loop().call_later(_POLL_SECONDS, self._polled)

    def _polled(self) -> None:
        self._poll = None
        self._admit_waiters()
        if len(self._queue):
            self._poll_soon()

    def _take_tenant(self, tenant: str | None) -> Hashable | None:
        cap = self.limits.max_concurrent_per_tenant
        if tenant is None or cap is None:
            return None
        key = self._counts.key(tenant)
        if not self._counts.take(key, cap):
            message = f"Tenant `{tenant}` is at its limit of {cap} concurrent requests."
            raise self._refused(Refusal.TENANT_CAP, message)
        return key

    def _give_tenant(self, held: Hashable | None) -> None:
        if held is not None:
            self._counts.give(held)

    def _queue_changed(self, waiter: Waiter, change: int) -> None:
        """`waiter` joined (`change` 1) or left (-1) the queue."""
        rank, label = waiter.rank, waiter.label
        depth = self._tenant_depth.get(label, 0) + change
        if depth:
            self._tenant_depth[label] = depth
        else:
            self._tenant_depth.pop(label, None)  # bounded: only labels with waiters
        if self._metrics is not None:
            self._metrics.admission_queue.set(len(self._queue))
            self._metrics.flow_queue.labels(PRIORITIES[rank]).set(self._queue.depth(rank))
            self._metrics.flow_tenant_queue.labels(label).set(depth)
        self._counts.set_waiting(rank, self._queue.depth(rank))

    def _refused(self, why: Refusal, message: str) -> Overloaded:
        """The refusal to raise, counted, its Retry-After from the drain rate."""
        if self._metrics is not None:
            self._metrics.admission_rejections.labels(why).inc()
        retry = self._drain.retry_after(len(self._queue))
        return Overloaded(message, drop_reason=why.value, retry_after=retry)
