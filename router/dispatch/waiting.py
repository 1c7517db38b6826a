"""Admission's wait queue in one worker: a request joins it (or is refused: its class's
queue or the router's is full; or it sheds a waiter of a lower class), waits up to its
class's `queue_timeout` for a slot handed to it, or gives up. Admission (admission.py)
hands the slots; while this worker has waiters, a poll every `_POLL_SECONDS` asks it to
look for one freed in another worker, or a backend that left saturation.

Each change of the queue sets its gauges (total, by class, by tenant) and tells the
counts this worker's waiters per class; each waiter's wait is observed by class and by
tenant; each refusal is counted, its Retry-After from the drain rate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from router.config import PRIORITIES
from router.dispatch.counts import Counts
from router.dispatch.flow import DrainRate, FlowQueue, Waiter
from router.dispatch.signals import PENDING
from router.errors import Overloaded
from router.metrics import Metrics, Refusal

#: how often a worker with waiters looks for a slot freed in another worker
_POLL_SECONDS = 0.01


class Waiting:
    """This worker's waiters, in `queue`; `admit` hands them the slots free now, and
    `pass_on` passes on a slot handed to a waiter that gave up."""

    def __init__(
        self,
        queue: FlowQueue,
        counts: Counts,
        drain: DrainRate,
        metrics: Metrics | None,
        full: Callable[[], bool],
        tenant_label: Callable[[str | None], str],
        admit: Callable[[], None],
        pass_on: Callable[[], None],
    ) -> None:
        self._queue = queue
        self._counts = counts
        self._drain = drain
        self._metrics = metrics
        self._full = full
        self._tenant_label = tenant_label
        self._admit = admit
        self._pass_on = pass_on
        #: this worker's waiters by tenant label
        self._tenant_depth: dict[str, int] = {}
        self._poll: asyncio.TimerHandle | None = None
        #: waiters handed a slot whose tasks have not yet run on to their backend,
        #: counted in the flow signals, where every worker's are summed
        self._cells = counts.cells

    async def wait(self, tenant: str, rank: int, queue_size: int) -> float:
        """Wait in the queue for a slot (`queue_size`: the router's queue's, per worker);
        the seconds waited."""
        queue = self._queue
        name = PRIORITIES[rank]
        if queue.depth(rank) >= queue.queue_size(name):
            raise self.refused(Refusal.QUEUE_FULL, f"The `{name}` queue is full.")
        if len(queue) >= queue_size:
            victim = queue.lower_than(rank)
            if victim is None:
                raise self.refused(Refusal.QUEUE_FULL, "The router's wait queue is full.")
            queue.remove(victim)
            self._changed(victim, -1)
            victim.future.set_exception(
                self.refused(Refusal.SHED, "Shed for a request of a higher priority.")
            )
        waiter = Waiter(tenant, rank, asyncio.get_running_loop().create_future())
        waiter.label = self._tenant_label(tenant or None)
        queue.push(waiter)
        self._changed(waiter, 1)
        self._poll_soon()
        try:
            async with asyncio.timeout(queue.queue_timeout(name)):
                await waiter.future
            self._cells.add(PENDING, -1)
        except BaseException as exc:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self._cells.add(PENDING, -1)
                self._pass_on()  # handed a slot just as we gave up
            elif queue.remove(waiter):
                self._changed(waiter, -1)
            if isinstance(exc, TimeoutError):
                if self._full():
                    raise self.refused(
                        Refusal.SATURATED, "Every backend is saturated; the wait timed out."
                    ) from None
                raise self.refused(
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

    def wake(self, under_share: Callable[[str], bool] | None = None) -> bool:
        """Hand a slot to the next live waiter (by flow order; or with `under_share`, a
        slot of the reserve, flow.py's `pop_reserved`); False if there is none, or if
        another worker has a waiter of a higher class and none here is past its
        `max_wait` (that worker's poll takes the slot)."""
        queue = self._queue
        while len(queue) and not self._counts.waiting_above(queue.release_rank()):
            waiter = queue.pop() if under_share is None else queue.pop_reserved(under_share)
            if waiter is None:
                return False
            self._changed(waiter, -1)
            if not waiter.future.done():  # a cancelled one is queued until its task runs
                waiter.future.set_result(None)
                self._cells.add(PENDING, 1)
                return True
        return False

    @property
    def pending(self) -> int:
        """The router's released waiters whose requests do not yet count on a backend."""
        return self._cells.total(PENDING)

    def refused(self, why: Refusal, message: str) -> Overloaded:
        """The refusal to raise, counted, its Retry-After from the drain rate."""
        if self._metrics is not None:
            self._metrics.admission_rejections.labels(why).inc()
        retry = self._drain.retry_after(len(self._queue))
        return Overloaded(message, drop_reason=why.value, retry_after=retry)

    def _poll_soon(self) -> None:
        """Look again soon for a slot another worker freed, or a backend that left
        saturation (neither wakes this worker)."""
        if self._poll is None:
            self._poll = asyncio.get_running_loop().call_later(_POLL_SECONDS, self._polled)

    def _polled(self) -> None:
        self._poll = None
        self._admit()
        if len(self._queue):
            self._poll_soon()

    def _changed(self, waiter: Waiter, change: int) -> None:
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
