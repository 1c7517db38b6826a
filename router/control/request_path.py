"""A worker's request path: the records (access log and tracer), the dispatcher, the
async jobs and the listeners over them.

Opened in that order once the node's backend-facing parts run (router/control/node.py),
on the config replayed edits may have changed; drained together at shutdown, then
closed. `Router` (router/control/worker.py) owns one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from router.config import Config
from router.context import WorkerContext
from router.control.admin import AdminServer
from router.control.listeners import Listeners
from router.control.node import Node
from router.control.tls import ServingTls
from router.dispatch.dispatcher import Dispatcher
from router.dispatch.records import Records
from router.dispatch.shared_admission import AdmissionTable
from router.fleet.backends import Backend
from router.jobs.runner import JobRunner
from router.jobs.stores import open_store


class RequestPath:
    """What a worker adds to a node to serve: built at start, drained and closed at stop."""

    def __init__(
        self,
        config: Config,
        context: WorkerContext | None,
        admin: AdminServer | None,
        tls: ServingTls,
        span_exporter=None,
    ) -> None:
        #: the access log and the tracer
        self.records = Records(config, span_exporter)
        self.listeners = Listeners(context, admin, tls)
        self.dispatcher: Dispatcher | None = None
        #: async jobs and batches, when `jobs.enabled`
        self.jobs: JobRunner | None = None

    async def open(
        self,
        node: Node,
        session: aiohttp.ClientSession,
        refused: Callable[[Backend], None],
        admission: AdmissionTable | None,
    ) -> None:
        """The dispatcher over `node`'s fleet, the jobs, then the listeners over them;
        the jobs run once the listeners take requests."""
        cfg = node.config
        self.records.open(node.metrics)
        self.dispatcher = Dispatcher(
            cfg,
            node.fleet,
            node.metrics,
            session,
            refused,
            admission,
            self.records,
            lambda: node.auth.tenants,
        )
        if cfg.jobs.enabled:
            store = await asyncio.to_thread(open_store, cfg.jobs)
            self.jobs = JobRunner(cfg.jobs, store, self.dispatcher, node.fleet, node.metrics)
        await self.listeners.start(
            cfg,
            node.fleet,
            self.dispatcher,
            node.metrics,
            node.auth,
            node.telemetry,
            node.admin_token,
            self.jobs,
        )
        if self.jobs is not None:
            self.jobs.start()

    async def unready(self, seconds: float) -> None:
        """/ready turns 503 for `seconds`, so load balancers stop sending before the
        listeners close (no wait when nothing was opened)."""
        if self.dispatcher is not None:
            self.dispatcher.draining = True
            await asyncio.sleep(seconds)

    async def close(self, drain_seconds: float) -> None:
        """The jobs stop (what runs goes back in the queue for the next start) beside
        the drain, which waits for no job store: one that fails or hangs leaves the
        interactive requests their drain. Then the admin API, the idle upstream
        connections and the records."""
        stopping = [] if self.jobs is None else [self.jobs.stop()]
        await asyncio.gather(*stopping, self._drain(drain_seconds))
        await self.listeners.stop_admin()
        if self.dispatcher is not None:
            self.dispatcher.close()
        await self.records.close()

    async def _drain(self, drain_seconds: float) -> None:
        """Both listeners stop taking connections and RPCs at once; the requests in
        flight on either get `drain_seconds` to end together, then the dispatcher ends
        each one left with a "shutting down" error, and the servers close what remains."""
        steps = self.listeners.closing(drain_seconds)
        if self.dispatcher is not None:
            steps.append(self.dispatcher.drain(drain_seconds))
        await asyncio.gather(*steps)

    def configure(self, config: Config) -> None:
        """A reload's swap: the dispatcher takes the new timeouts, limits and retries."""
        if self.dispatcher is not None:
            self.dispatcher.configure(config)
