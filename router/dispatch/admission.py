"""Admission: a router-wide concurrency limit with a wait queue, and per-tenant caps.

`enter` admits a request at once while fewer than `max_concurrent_requests` are active
and the fleet has room (saturation.py); otherwise it waits in the queue of router/dispatch/
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
not dip and a newcomer cannot barge past the queue, but for one of a tenant under its
share, flow.py, taking fleet room that other tenants' waiters may not); a waiter that
gives up (timeout, client gone) after its slot was handed over passes it on. `enter`
returns what `leave` must give back, so a reload that changes the caps in between
cannot unbalance the per-tenant counts. Cost: O(1) per request, O(queue) only when a
waiter gives up.

Metrics (waiting.py): each refusal by its reason, and the queue's depth (total, by
class and by tenant) and each waiter's wait by class and by tenant, the tenant bounded
as every tenant label is (`metrics.tenants` and the static tokens' by name, else
`(other)`), set only when the queue changes (a request admitted at once touches no
metric here).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Hashable
from functools import partial
from typing import NamedTuple

from router.config import PRIORITIES, FlowConfig, LimitsConfig
from router.dispatch.counts import Counts, LocalCounts
from router.dispatch.flow import DEFAULT_CLASS, DrainRate, FlowQueue, rank_of
from router.dispatch.reserve import Reserve
from router.dispatch.saturation import Room, Unbounded
from router.dispatch.shared_admission import TOTAL
from router.dispatch.waiting import Waiting
from router.metrics import Metrics, Refusal


class Held(NamedTuple):
    """What an admitted request holds, given back by `leave`."""

    tenant: str
    #: the key its tenant is counted under (against `max_concurrent_per_tenant`, if capped)
    key: Hashable


class Admission:
    """The caps' slots: taken at once, or handed to the queue's waiters (waiting.py)."""

    def __init__(
        self,
        limits: LimitsConfig,
        counts: Counts | None = None,
        metrics: Metrics | None = None,
        flow: FlowConfig | None = None,
        room: Room | None = None,
        tenant_label: Callable[[str | None], str] = lambda tenant: tenant or "",
    ) -> None:
        """`room`: the fleet's room for more requests (saturation.py's `FleetRoom`);
        `tenant_label`: a tenant's label in the metrics (bounded)."""
        self.limits = limits
        self.active = 0
        self._counts = counts or LocalCounts()
        self._queue = FlowQueue(flow or FlowConfig(), limits)
        self._room = room or Unbounded()
        self._drain = DrainRate(self._counts.cells)
        self._waiting = Waiting(
            self._queue,
            self._counts,
            self._drain,
            metrics,
            self._room.full,
            tenant_label,
            self._admit_waiters,
            partial(self.leave, None),
        )
        #: a fleet of unknown bounds held requests back since the queue was last empty:
        #: release paced
        self._held_back = False
        #: the fleet's room kept for tenants under their share and higher classes
        self._reserve = Reserve(self._room, self._counts, self._drain, self._queue.weight)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def configure(self, limits: LimitsConfig, flow: FlowConfig | None = None) -> None:
        """New limits (reload); waiters that now fit are admitted."""
        self.limits = limits
        self._queue.configure(flow or self._queue.flow, limits)
        self._reserve.shares.reweigh()
        self._admit_waiters()

    async def enter(self, tenant: str | None, priority: str = DEFAULT_CLASS) -> Held:
        """Take a slot (waiting if need be) or raise Overloaded; returns what `leave`
        gives back."""
        return (await self.enter_timed(tenant, priority))[0]

    async def enter_timed(
        self, tenant: str | None, priority: str = DEFAULT_CLASS
    ) -> tuple[Held, float]:
        """`enter`'s holding, and the seconds the request waited in the queue (0: it was
        admitted at once)."""
        held = Held(tenant or "", self._take_tenant(tenant))
        self._reserve.shares.arrive(held.tenant)
        try:
            waited = await self._take_slot(held.tenant, rank_of(priority))
        except BaseException:
            self._reserve.shares.depart(held.tenant)
            self._give_tenant(held.key)
            raise
        return held, waited

    def leave(self, held: Held | None) -> None:
        """An admitted request ended (`held`: what it entered with), or a slot handed to
        a waiter that gave up comes back (None)."""
        if held is not None:
            self._reserve.shares.depart(held.tenant)
            self._give_tenant(held.key)
        self._drain.left()
        if not len(self._queue) or not self._release():  # else handed over
            self._give_slot()

    def _spare(self, enough: float, probe: bool = False) -> float:
        """The fleet's room, less the waiters released whose requests do not yet count
        on a backend (none: requests are held back, and released paced while the
        bounds are unknown)."""
        pending = self._waiting.pending
        spare = self._room.free(enough + pending, probe) - pending
        if spare < 1:
            self._held_back = True
        return spare

    def _grant(self) -> tuple[float, bool]:
        """The fleet's room now, and whether a backlog may take it: past the reserve,
        or a backend's probe when there is no other room and no request the reserve is
        for came lately (a probe's request waits in that backend's own queue and takes
        the next slot freed there, which those requests would have had)."""
        reserve = self._reserve.size()
        spare = self._spare(reserve + 1)
        if spare >= 1 or reserve:
            return spare, spare > reserve
        return self._spare(1, probe=True), True

    def _wake(self, backlog: bool) -> bool:
        """Hand a slot to the next waiter: any for a backlog, else one the reserve
        keeps for."""
        return self._waiting.wake(None if backlog else self._reserve.under_share)

    def _release(self) -> bool:
        """Hand the slot of a request that left to the next waiter the fleet has room
        for; False if none may go."""
        spare, backlog = self._grant()
        return spare >= 1 and self._wake(backlog)

    def _admit_waiters(self) -> None:
        """Hand the slots free now to the waiters, in flow order. After a fleet of
        unknown bounds (no batch limit learned) held requests back, one per call (each
        poll, each reload): a released request counts on its backend only once its task
        runs, and releasing a whole backlog at once, the moment one backend leaves
        saturation, would flood that backend's queue. Where the bounds are known, the
        released ones not yet counted are subtracted from the room instead."""
        queue = self._queue
        while len(queue) and not self._counts.waiting_above(queue.release_rank()):
            spare, backlog = self._grant()
            if spare < 1:
                return
            if not self._take_total():
                return
            if not self._wake(backlog):
                self._give_slot()
                return
            if self._held_back and spare == math.inf:
                break
        if not len(queue):
            self._held_back = False

    def _take_total(self) -> bool:
        if not self._counts.take(TOTAL, self.limits.max_concurrent_requests):
            return False
        self.active += 1
        return True

    def _give_slot(self) -> None:
        self.active -= 1
        self._counts.give(TOTAL)

    async def _take_slot(self, tenant: str, rank: int) -> float:
        """Take a slot, waiting in the queue if need be; the seconds waited there. A
        request of a flow with none waiting here, and no waiter of a higher class
        anywhere, goes at once while the fleet has room: room past the reserve, or any
        when it may take the reserve (flow.py: no waiter anywhere, or it outranks one,
        or its tenant is under its share)."""
        queue, counts = self._queue, self._counts
        if (
            not queue.waits(tenant, rank)
            and not queue.waits_above(rank)
            and not counts.waiting_above(rank)
        ):
            waiters = counts.waiting_in(range(len(PRIORITIES)))
            outranking = counts.waiting_in(range(rank + 1, len(PRIORITIES)))
            may = not waiters or outranking or self._reserve.under_share(tenant)
            if may and waiters:
                self._reserve.wanted(outranking)
            reserve = self._reserve.size()
            spare = self._spare(reserve + 1)
            if (spare > reserve or (may and spare >= 1)) and self._take_total():
                return 0.0
        return await self._waiting.wait(tenant, rank, self.limits.queue_size)

    def _take_tenant(self, tenant: str | None) -> Hashable:
        """Count the request under its tenant's key (the fair shares read the count),
        within `max_concurrent_per_tenant` for a named tenant."""
        cap = self.limits.max_concurrent_per_tenant
        key = self._counts.key(tenant or "")
        if tenant is None or cap is None:
            cap = sys.maxsize
        if not self._counts.take(key, cap):
            message = f"Tenant `{tenant}` is at its limit of {cap} concurrent requests."
            raise self._waiting.refused(Refusal.TENANT_CAP, message)
        return key

    def _give_tenant(self, key: Hashable) -> None:
        self._counts.give(key)
