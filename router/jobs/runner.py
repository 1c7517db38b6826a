"""A worker's job runner: it claims a job only while the fleet has spare capacity, and
has it run (execute.py: through the dispatcher as an interactive request would go, its
answer recorded).

Priority: interactive requests never wait for a job. A job is claimed only while fewer
than `concurrency` run in this worker and the usable backends' requests in flight (the
router's, every worker's, jobs included) are below `spare_share` of their capacity: the
strategy's `concurrency_threshold` a backend, else `backend_capacity`. Otherwise the
runner looks again after `poll_s`. While a job runs its lease is renewed every third of
`lease_s`, so a worker that dies leaves a lease that runs out and another claims the job
(at-least-once). The batch line that ends its batch writes the batch's files; a batch
whose last line's worker died before that is ended by any worker's sweep, which also
drops what is past its TTL. Beside it, the worker delivers the webhooks that are due
(webhooks.py).

A store that fails (faults.py) stops neither loop: each waits, twice as long after each
failure from `poll_s` up to `_BACKOFF_CAP_S`, and tries again; a job whose answer could
not be stored runs again once its lease runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import socket
import time
from collections.abc import Callable
from typing import cast

from router.config import JobsConfig
from router.dispatch.dispatcher import Dispatcher
from router.errors import StoreUnavailable
from router.fleet.backends import Fleet
from router.jobs.execute import Executor
from router.jobs.faults import GuardedStore, StoreFaults
from router.jobs.store import Job, JobStore
from router.jobs.webhooks import Deliveries
from router.metrics import Metrics

#: a worker sweeps (ends the batches whose settle was missed, drops what is past its
#: TTL) at most this often, and at most once a lease
_SWEEP_EVERY_S = 60.0
#: the longest wait between two tries of a store that fails
_BACKOFF_CAP_S = 30.0


class JobRunner:
    """Claims and runs jobs in one worker; `wake` when one was just accepted here."""

    def __init__(
        self,
        cfg: JobsConfig,
        store: JobStore,
        dispatcher: Dispatcher,
        fleet: Fleet,
        metrics: Metrics,
        now: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._cfg = cfg
        self._fleet = fleet
        self._now = now
        self._owner = f"{socket.gethostname()}-{os.getpid()}-{random.getrandbits(32):08x}"
        #: the store's failures: /ready's body shows them
        self.faults = StoreFaults(metrics)
        self.store = cast(JobStore, GuardedStore(store, self.faults))
        self._executor = Executor(cfg, self.store, dispatcher, self._owner, metrics, now)
        self._running: set[asyncio.Task] = set()
        self._woken = asyncio.Event()
        self._swept = -math.inf
        self._loops: list[asyncio.Task] = []
        self._metrics = metrics
        self._hooks = Deliveries(cfg, self.store, metrics)

    def wake(self) -> None:
        self._woken.set()

    def start(self) -> None:
        """The claiming loop, and the webhooks' when any host may take one."""
        self._loops = [asyncio.create_task(self._claiming(), name="kvroute-jobs")]
        if self._cfg.webhook_hosts:
            self._loops.append(asyncio.create_task(self._delivering(), name="kvroute-webhooks"))

    async def _claiming(self) -> None:
        """Claim and start jobs for as long as the worker serves; between tries, wait
        for a job accepted here or one ended here, or `poll_s` (the back-off while the
        store fails)."""
        backoff = Backoff(self._cfg.poll_s)
        while True:
            self._woken.clear()
            try:
                if await self._claim():
                    continue
            except StoreUnavailable:  # a job accepted here says the store is back
                await self._woken_or(backoff.next())
                continue
            backoff.reset()
            await self._woken_or(self._cfg.poll_s)

    async def _woken_or(self, seconds: float) -> None:
        """Wait for a job accepted or ended here, or `seconds`."""
        # not wait_for: on 3.11 it swallows a cancel that lands as the wait ends
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._woken.wait()

    async def _claim(self) -> bool:
        """Start the next job if there is room for it (whether one started); when none
        waits, sweep now and then."""
        cfg = self._cfg
        if len(self._running) >= cfg.concurrency or not self._spare():
            return False
        job = await asyncio.to_thread(self.store.claim, self._owner, cfg.lease_s)
        if job is None:
            await self._sweep()
            return False
        self._metrics.job_attempts.inc()
        self._start(job)
        return True

    async def _delivering(self) -> None:
        """Deliver the due webhooks; when none is due, look again after `poll_s`."""
        backoff = Backoff(self._cfg.poll_s)
        while True:
            try:
                delivered = await self._hooks.deliver_due()
            except StoreUnavailable:
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            if not delivered:
                await asyncio.sleep(self._cfg.poll_s)

    def _start(self, job: Job) -> None:
        task = asyncio.create_task(self._executor.run(job), name=f"kvroute-job-{job.id}")
        self._running.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        self._woken.set()

    async def _sweep(self) -> None:
        """Now and then: end the batches none of whose lines waits or runs (the worker
        of the last one died before it ended the batch), and drop what is past its TTL."""
        every = min(_SWEEP_EVERY_S, self._cfg.lease_s)
        if self._now() - self._swept < every:
            return
        self._swept = self._now()
        for batch_id in await asyncio.to_thread(self.store.unsettled):
            await self._executor.settle(batch_id)
        await asyncio.to_thread(self.store.expire)

    async def stop(self) -> None:
        """Claim no more, and put the jobs running here back in the queue: they run
        again, here after a restart or in another worker. With the store failing they
        stay leased to this worker, and run again once their leases run out."""
        tasks = [*self._running, *self._loops]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._hooks.close()
        with contextlib.suppress(StoreUnavailable):
            await asyncio.to_thread(self.store.release, self._owner)

    def _spare(self) -> bool:
        """Below `spare_share` of the usable backends' capacity."""
        cfg = self._cfg
        cap = getattr(self._fleet.policy.params, "concurrency_threshold", None)
        usable = [b for b in self._fleet.members if b.usable]
        capacity = (cap or cfg.backend_capacity) * len(usable)
        return sum(b.inflight for b in usable) < cfg.spare_share * capacity


class Backoff:
    """The waits between tries of a store that fails: `first`, then twice the one
    before, up to `_BACKOFF_CAP_S`; from `first` again once a try went through."""

    def __init__(self, first: float) -> None:
        self._first = self._next = first

    def next(self) -> float:
        wait = self._next
        self._next = min(wait * 2, _BACKOFF_CAP_S)
        return wait

    def reset(self) -> None:
        self._next = self._first
