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
`_POLL_SECONDS`, armed only while this worker has waiters. The queue's side (joining,
shedding, waiting, giving up, its metrics) is waiting.py's; the counts are counts.py's.

Invariants: `active` counts this worker's admitted requests exactly, as the counts'
total does. A freed slot is handed straight to the next waiter (so the count does
not dip and a newcomer cannot barge past the queue); a waiter that gives up (timeout,
client gone) after its slot was handed over passes it on. `enter` returns what `leave`
must give back, so a reload that changes the caps in between cannot unbalance the
per-tenant counts. Cost: O(1) per request, O(queue) only when a waiter gives up.

Metrics (waiting.py): each refusal by its reason, and the queue's depth (total, by
class and by tenant) and each waiter's wait by class and by tenant, the tenant bounded
as every tenant label is (`metrics.tenants` and the static tokens' by name, else
`(other)`), set only when the queue changes (a request admitted at once touches no
metric here).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import partial

from router.config import FlowConfig, LimitsConfig
from router.dispatch.counts import Counts, LocalCounts
from router.dispatch.flow import DEFAULT_CLASS, DrainRate, FlowQueue, rank_of
from router.dispatch.shared_admission import TOTAL
from router.dispatch.waiting import Waiting
from router.metrics import Metrics, Refusal


class Admission:
    """The caps' slots: taken at once, or handed to the queue's waiters (waiting.py)."""

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
        self._queue = FlowQueue(flow or FlowConfig(), limits)
        self._saturated = saturated
        self._drain = DrainRate()
        self._waiting = Waiting(
            self._queue,
            self._counts,
            self._drain,
            metrics,
            saturated,
            tenant_label,
            self._admit_waiters,
            partial(self.leave, None),
        )
        #: saturation held requests back since the queue was last empty: release paced
        self._held_back = False

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
        if (
            not len(self._queue) or self._saturated() or not self._waiting.wake()
        ):  # else handed over
            self._give_slot()

    def _admit_waiters(self) -> None:
        """Hand the slots free now to the waiters, in flow order. After the fleet was
        saturated, one per call (each poll, each reload): a released request counts on
        its backend only once its task runs, so releasing a whole backlog at once, the
        moment one backend leaves saturation, would flood that backend's queue."""
        queue = self._queue
        paced = self._held_back
        while len(queue) and not self._counts.waiting_above(queue.top_rank()) and self._free_slot():
            if not self._waiting.wake():  # only cancelled ones were left
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
        if not len(self._queue) and not self._counts.waiting_above(rank) and self._free_slot():
            return 0.0
        return await self._waiting.wait(tenant, rank, self.limits.queue_size)

    def _take_tenant(self, tenant: str | None) -> Hashable | None:
        cap = self.limits.max_concurrent_per_tenant
        if tenant is None or cap is None:
            return None
        key = self._counts.key(tenant)
        if not self._counts.take(key, cap):
            message = f"Tenant `{tenant}` is at its limit of {cap} concurrent requests."
            raise self._waiting.refused(Refusal.TENANT_CAP, message)
        return key

    def _give_tenant(self, held: Hashable | None) -> None:
        if held is not None:
            self._counts.give(held)
