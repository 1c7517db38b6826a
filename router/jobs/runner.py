"""A worker's job runner: it claims a job only while the fleet has spare capacity, runs
it through the dispatcher as an interactive request would go, and records the answer.

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

from multidict import CIMultiDict

from router import log
from router.config import JobsConfig
from router.dispatch.call import Call
from router.dispatch.dispatcher import Dispatcher
from router.dispatch.flow import BACKGROUND
from router.errors import KvrouteError, NoBackendAvailable, Overloaded, StoreUnavailable
from router.fleet.backends import Fleet
from router.jobs.faults import GuardedStore, StoreFaults
from router.jobs.store import Job, JobStore, runs_as
from router.jobs.webhooks import Deliveries
from router.jobs.wire import KINDS, new_id, write_outputs
from router.metrics import Metrics
from router.request import parse

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
        self._dispatch = dispatcher
        self._fleet = fleet
        self._now = now
        self._owner = f"{socket.gethostname()}-{os.getpid()}-{random.getrandbits(32):08x}"
        #: the store's failures: /ready's body shows them
        self.faults = StoreFaults(metrics)
        self.store = cast(JobStore, GuardedStore(store, self.faults))
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
        task = asyncio.create_task(self._run(job), name=f"kvroute-job-{job.id}")
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
            await self._settle(batch_id)
        await asyncio.to_thread(self.store.expire)

    async def _settle(self, batch_id: str) -> None:
        files = (new_id("file-"), new_id("file-"))
        ttl = self._cfg.result_ttl_s
        await asyncio.to_thread(self.store.settle, batch_id, files, write_outputs, ttl)

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

    async def _run(self, job: Job) -> None:
        renewing = asyncio.create_task(self._renew(job))
        try:
            status, body = await self._answer(job)
        finally:
            renewing.cancel()
        outcome = "succeeded" if status < 400 else "failed"
        store, ttl = self.store, self._cfg.result_ttl_s
        try:
            if not await asyncio.to_thread(
                store.finish, job.id, self._owner, outcome, status, body, ttl
            ):
                return  # its lease ran out and another worker runs it
            self._metrics.jobs_ended.labels(outcome).inc()
            if job.batch_id is not None:
                await self._settle(job.batch_id)
        except StoreUnavailable:
            return  # it runs again once its lease runs out; its batch ends at a sweep

    async def _answer(self, job: Job) -> tuple[int, bytes]:
        """The job's answer, or the router's error. A refusal that passes (admission's
        429, no backend available: the fleet is full or down for now) is tried again
        `refused_retries` times, each after twice the wait of the one before, since a
        job's client is not there to retry it; the job keeps its lease meanwhile."""
        cfg, tried = self._cfg, 0
        while True:
            try:
                return await self._exchange(job)
            except (Overloaded, NoBackendAvailable) as err:
                if tried == cfg.refused_retries:
                    return err.status, err.http_answer({})[1]
                self._metrics.job_refusals_retried.inc()
                await asyncio.sleep(cfg.refused_backoff_s * 2**tried)
                tried += 1
            except KvrouteError as err:
                return err.status, err.http_answer({})[1]

    async def _exchange(self, job: Job) -> tuple[int, bytes]:
        """The job's request through the dispatcher: the answer's status and body."""
        kind = KINDS[job.path]
        headers = CIMultiDict({"Content-Type": "application/json", "X-Request-Id": job.id})
        started = asyncio.get_running_loop().time()
        call = Call(
            kind,
            parse(kind, job.body),
            "POST",
            job.path,
            job.body,
            headers,
            started,
            self._now(),
            runs_as(job.tenant),
            job.id,
        )
        call.priority = BACKGROUND  # below every interactive request
        async with self._dispatch.exchange(call) as upstream:
            return upstream.status, await upstream.read()

    async def _renew(self, job: Job) -> None:
        lease = self._cfg.lease_s
        while True:
            await asyncio.sleep(lease / 3)
            try:
                renewed = await asyncio.to_thread(self.store.renew, job.id, self._owner, lease)
            except StoreUnavailable:
                continue  # the next third of the lease may find the store back
            if not renewed:
                log.requests_failed.warning("job %s: its lease was lost", job.id)
                self._metrics.job_leases_lost.inc()
                return


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
