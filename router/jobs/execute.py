"""One claimed job, run: its request through the dispatcher as an interactive request
would go (below every one of them), a refusal that passes tried again, its lease renewed
every third of `lease_s` while it runs, its answer recorded, and its batch ended when it
was the batch's last line.

A store that fails while it runs leaves the job leased: it runs again once its lease
runs out, and its batch ends at a sweep (runner.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from multidict import CIMultiDict

from router import log
from router.config import JobsConfig
from router.dispatch.call import Call
from router.dispatch.dispatcher import Dispatcher
from router.dispatch.flow import BACKGROUND
from router.errors import KvrouteError, NoBackendAvailable, Overloaded, StoreUnavailable
from router.jobs.store import Job, JobStore, runs_as
from router.jobs.wire import KINDS, new_id, write_outputs
from router.metrics import Metrics
from router.request import parse


class Executor:
    """Runs the jobs one worker claimed, as `owner`, and ends their batches."""

    def __init__(
        self,
        cfg: JobsConfig,
        store: JobStore,
        dispatcher: Dispatcher,
        owner: str,
        metrics: Metrics,
        now: Callable[[], float],
    ) -> None:
        self._cfg = cfg
        self._store = store
        self._dispatch = dispatcher
        self._owner = owner
        self._metrics = metrics
        self._now = now

    async def run(self, job: Job) -> None:
        renewing = asyncio.create_task(self._renew(job))
        try:
            status, body = await self._answer(job)
        finally:
            renewing.cancel()
        outcome = "succeeded" if status < 400 else "failed"
        store, ttl = self._store, self._cfg.result_ttl_s
        try:
            if not await asyncio.to_thread(
                store.finish, job.id, self._owner, outcome, status, body, ttl
            ):
                return  # its lease ran out and another worker runs it
            self._metrics.jobs_ended.labels(outcome).inc()
            if job.batch_id is not None:
                await self.settle(job.batch_id)
        except StoreUnavailable:
            return  # it runs again once its lease runs out; its batch ends at a sweep

    async def settle(self, batch_id: str) -> None:
        """End the batch: write its output and error files."""
        files = (new_id("file-"), new_id("file-"))
        ttl = self._cfg.result_ttl_s
        await asyncio.to_thread(self._store.settle, batch_id, files, write_outputs, ttl)

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
                renewed = await asyncio.to_thread(self._store.renew, job.id, self._owner, lease)
            except StoreUnavailable:
                continue  # the next third of the lease may find the store back
            if not renewed:
                log.requests_failed.warning("job %s: its lease was lost", job.id)
                self._metrics.job_leases_lost.inc()
                return
