"""A worker's job runner: it claims a job only while the fleet has spare capacity, runs
it through the dispatcher as an interactive request would go, and records the answer.

Priority: interactive requests never wait for a job. A job is claimed only while fewer
than `concurrency` run in this worker and the usable backends' requests in flight (the
router's, every worker's, jobs included) are below `spare_share` of their capacity: the
strategy's `concurrency_threshold` a backend, else `backend_capacity`. Otherwise the
runner looks again after `poll_s`. While a job runs its lease is renewed every third of
`lease_s`, so a worker that dies leaves a lease that runs out and another claims the job
(at-least-once). The batch line that ends its batch writes the batch's files. Beside it,
the worker delivers the webhooks that are due (webhooks.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import time
from collections.abc import Callable

from multidict import CIMultiDict

from router import log
from router.config import JobsConfig
from router.dispatch.call import Call
from router.dispatch.dispatcher import Dispatcher
from router.dispatch.flow import BACKGROUND
from router.errors import KvrouteError, NoBackendAvailable, Overloaded
from router.fleet.backends import Fleet
from router.jobs.store import Job, JobStore
from router.jobs.webhooks import Deliveries
from router.jobs.wire import KINDS, new_id, write_outputs
from router.metrics import Metrics
from router.request import parse

#: how often a worker drops what is past its TTL
_EXPIRE_EVERY_S = 60.0


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
        self.store = store
        self._running: set[asyncio.Task] = set()
        self._woken = asyncio.Event()
        self._expired = 0.0
        self._loops: list[asyncio.Task] = []
        self._metrics = metrics
        self._hooks = Deliveries(cfg, store, metrics)

    def wake(self) -> None:
        self._woken.set()

    def start(self) -> None:
        """The claiming loop, and the webhooks' when any host may take one."""
        self._loops = [asyncio.create_task(self._claiming(), name="kvroute-jobs")]
        if self._cfg.webhook_hosts:
            self._loops.append(asyncio.create_task(self._delivering(), name="kvroute-webhooks"))

    async def _claiming(self) -> None:
        """Claim and start jobs for as long as the worker serves; between tries, wait
        for a job accepted here or one ended here, or `poll_s`."""
        cfg = self._cfg
        while True:
            self._woken.clear()
            if len(self._running) < cfg.concurrency and self._spare():
                job = await asyncio.to_thread(self.store.claim, self._owner, cfg.lease_s)
                if job is not None:
                    self._metrics.job_attempts.inc()
                    self._start(job)
                    continue
                await self._expire()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), cfg.poll_s)

    async def _delivering(self) -> None:
        """Deliver the due webhooks; when none is due, look again after `poll_s`."""
        while True:
            if not await self._hooks.deliver_due():
                await asyncio.sleep(self._cfg.poll_s)

    def _start(self, job: Job) -> None:
        task = asyncio.create_task(self._run(job), name=f"kvroute-job-{job.id}")
        self._running.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        self._woken.set()

    async def _expire(self) -> None:
        """Drop what is past its TTL, now and then."""
        if self._now() - self._expired > _EXPIRE_EVERY_S:
            self._expired = self._now()
            await asyncio.to_thread(self.store.expire)

    async def stop(self) -> None:
        """Claim no more, and put the jobs running here back in the queue: they run
        again, here after a restart or in another worker."""
        tasks = [*self._running, *self._loops]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._hooks.close()
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
        if not await asyncio.to_thread(
            store.finish, job.id, self._owner, outcome, status, body, ttl
        ):
            return  # its lease ran out and another worker runs it
        self._metrics.jobs_ended.labels(outcome).inc()
        if job.batch_id is not None:
            files = (new_id("file-"), new_id("file-"))
            await asyncio.to_thread(store.settle, job.batch_id, files, write_outputs, ttl)

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
            job.tenant,
            job.id,
        )
        call.priority = BACKGROUND  # below every interactive request
        async with self._dispatch.exchange(call) as upstream:
            return upstream.status, await upstream.read()

    async def _renew(self, job: Job) -> None:
        lease = self._cfg.lease_s
        while True:
            await asyncio.sleep(lease / 3)
            if not await asyncio.to_thread(self.store.renew, job.id, self._owner, lease):
                log.requests_failed.warning("job %s: its lease was lost", job.id)
                self._metrics.job_leases_lost.inc()
                return
