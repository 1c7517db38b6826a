"""A worker: the request path of one process, and, on its own, a whole router.

`Router` runs the listeners (HTTP with its fast path, gRPC, the admin API in worker 0)
over one `Dispatcher`. As one of several workers (router/control/supervisor.py) it
shares in-flight counts, admission counts and placements with the others through the
run directory's tables, and takes its telemetry, health verdicts, model lists and
discovered backends from the collector's feed. Alone (`--workers 1`, or in tests) it
does that upkeep itself: its telemetry runs in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from aiohttp import web

from router import log
from router.config import Config
from router.context import WorkerContext
from router.control.admin import AdminServer
from router.control.listeners import Listeners
from router.control.node import STARTUP_POLL_SECONDS, Node
from router.control.reload import ConfigSource
from router.control.tls import ServingTls
from router.dispatch.dispatcher import Dispatcher
from router.dispatch.records import Records
from router.dispatch.shared_admission import AdmissionTable
from router.fleet.backends import Backend
from router.fleet.health import REFUSED
from router.fleet.placements import PlacementTable
from router.fleet.shared_load import LoadTable
from router.ingress.web import (
    HttpIngress,
)
from router.jobs.runner import JobRunner
from router.jobs.stores import open_store
from router.telemetry.loops import LocalTelemetry, Parts, Telemetry
from router.telemetry.worker_feed import WorkerTelemetry

_FEED_JOIN_SECONDS = 10.0  # a worker waits this long for the collector's feed to be live
_VERDICT_GRACE = 1.0  # beyond the collector's own admission checks, before checking itself


class Router(Node):
    """One router process that serves: listeners, dispatcher, the shared tables."""

    def __init__(
        self,
        config: Config,
        source: ConfigSource | None = None,
        context: WorkerContext | None = None,
        span_exporter=None,
    ) -> None:
        """Build the pieces; ConfigError if a secret or certificate the config names
        cannot be read, or tracing is on without the OpenTelemetry SDK. `span_exporter`:
        where the spans go when tracing is on (an SDK SpanExporter), instead of the
        configured OTLP endpoint."""
        self.table = self.placements = self.admission_counts = None
        if (ctx := context) is not None:
            self.table = LoadTable(ctx.table_path, ctx.slots, ctx.workers, ctx.index)
            self.placements = PlacementTable(ctx.placements_path, ctx.index, self._share)
            self.admission_counts = AdmissionTable(ctx.admission_path, ctx.workers, ctx.index)
        super().__init__(config, source, context, self.table, self.placements)
        self.tls = ServingTls.load(config)
        self.admin = None
        if self.admin_token is not None and (context is None or context.index == 0):
            self.admin = AdminServer(self, config.admin, self.admin_token)
        self.listeners = Listeners(context, self.admin, self.tls)
        self.dispatcher: Dispatcher | None = None
        #: the access log and the tracer
        self.records = Records(config, span_exporter)
        self.ingress: HttpIngress | None = None
        #: async jobs and batches, when `jobs.enabled`
        self.jobs: JobRunner | None = None
        self.port = self.grpc_port = 0
        self._runner: web.AppRunner | None = None  # the aiohttp app's (its routes)

    def _telemetry(self, parts: Parts) -> Telemetry:
        """Alone: telemetry in-process; one of several: the collector's feed."""
        if self.context is None:
            return LocalTelemetry(parts)
        return WorkerTelemetry(parts, self.context, self._edited, self.verdicts)

    @property
    def url(self) -> str:
        scheme = "http" if self.tls.http is None else "https"
        return f"{scheme}://{self.config.listen.host}:{self.port}"

    @property
    def fan_out(self) -> Callable[[bytes], Awaitable[None]] | None:
        """An admin edit to every worker, through the collector (none when alone)."""
        return None if self.context is None else self.telemetry.broadcast

    def _share(self, payload: bytes) -> None:
        """This worker's placements, to the others (dropped before telemetry starts)."""
        if self.telemetry is not None:
            self.telemetry.push_nowait(payload)

    def _refused(self, backend: Backend) -> None:
        """A connection to `backend` was refused: down here at once, and with several
        workers in the collector too, which tells every worker (router/fleet/health.py)."""
        if self.health.refused(backend) and self.telemetry is not None:
            self.telemetry.push_nowait(REFUSED + backend.name.encode())

    async def start(self) -> None:
        """Start in order; on any failure, stop what started and re-raise."""
        try:
            self.start_parts()
            await (self._own_upkeep() if self.context is None else self._join_collector())
            self.fleet.changed()
            await self._serve()
        except BaseException:
            await self.stop()
            raise
        log.server.info(
            "kvroute listening on %s, strategy %s, %s",
            self.url,
            self.dispatcher.strategy,
            log.counted(len(self.fleet.members), "backend"),
        )

    async def _own_upkeep(self) -> None:
        """Alone: discovery and the first probe round here."""
        self.run_discovery()
        await self.probe(None)

    async def _join_collector(self) -> None:
        """One of several: wait for the collector's feed, its verdicts and the edits it
        replays (bounded), so the first requests see the router's fleet."""
        if not await self.telemetry.joined(_FEED_JOIN_SECONDS):
            log.server.warning("the collector's feed is not live yet: edits may be missed")
        # the collector's first round is bounded; the edits it replays came before
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.verdicts.adopted.wait(), 2 * STARTUP_POLL_SECONDS)
        if self._edits:  # applied before serving (not cancelled if slow)
            await asyncio.wait(self._edits, timeout=STARTUP_POLL_SECONDS)

    async def _serve(self) -> None:
        """The dispatcher, on the config replayed edits may have changed, then the
        listeners over it."""
        cfg, lst = self.config, self.listeners
        self.records.open(self.metrics)
        self.dispatcher = Dispatcher(
            cfg,
            self.fleet,
            self.metrics,
            self._session,
            self._refused,
            self.admission_counts,
            self.records,
            lambda: self.auth.tenants,
        )
        self._tasks.append(asyncio.create_task(self.metrics.watch_loop_lag(), name="kvroute-lag"))
        if cfg.jobs.enabled:
            store = await asyncio.to_thread(open_store, cfg.jobs)
            self.jobs = JobRunner(cfg.jobs, store, self.dispatcher, self.fleet, self.metrics)
        await lst.start(
            cfg,
            self.fleet,
            self.dispatcher,
            self.metrics,
            self.auth,
            self.telemetry,
            self.admin_token,
            self.jobs,
        )
        if self.jobs is not None:
            self.jobs.start()
        self.ingress, self._runner = lst.ingress, lst.runner
        self.port, self.grpc_port = lst.port, lst.grpc_port

    async def stop(self) -> None:
        """The jobs stop (what runs goes back in the queue for the next start) beside
        the drain, which waits for no job store: one that fails or hangs leaves the
        interactive requests their drain."""
        stopping = [] if self.jobs is None else [self.jobs.stop()]
        await asyncio.gather(*stopping, self._drain())
        await self.listeners.stop_admin()
        if self.dispatcher is not None:
            self.dispatcher.close()  # idle upstream connections
        await self.records.close()
        await self.stop_parts()
        for table in (self.table, self.placements, self.admission_counts):
            if table is not None:
                table.close()

    async def _drain(self) -> None:
        """Both listeners stop taking connections and RPCs at once; the requests in
        flight on either get `shutdown.drain_seconds` to end together, then the
        dispatcher ends each one left with a "shutting down" error, and the servers
        close what remains."""
        drain = self.config.shutdown.drain_seconds
        steps = self.listeners.closing(drain)
        if self.dispatcher is not None:
            steps.append(self.dispatcher.drain(drain))
        await asyncio.gather(*steps)

    async def shutdown(self) -> None:
        """Graceful stop: /ready turns 503 first; after `shutdown.unready_seconds` the
        listeners close, and requests in flight get `shutdown.drain_seconds` to end;
        those still open then end with a "shutting down" error (`_drain`)."""
        if self.dispatcher is not None:
            self.dispatcher.draining = True
            await asyncio.sleep(self.config.shutdown.unready_seconds)
        await self.stop()

    async def admit(self, added: list[Backend], everywhere: bool) -> None:
        """Health and models of backends about to join (reload, admin API, discovery).

        A worker of several whose change the collector applies too (`everywhere`: a
        SIGHUP, an edit broadcast by worker 0, discovered backends) takes the
        collector's verdicts, so each backend is checked once for the router; it checks
        itself only the ones the collector said nothing of in time.
        """
        if everywhere and self.context is not None:
            wait = max(self.config.health.timeout, STARTUP_POLL_SECONDS) + _VERDICT_GRACE
            added = await self.verdicts.take(added, wait)
        if added:
            await super().admit(added, everywhere)

    def admitted(self) -> None:
        """Nothing to tell: only the collector feeds other processes."""

    def reopen_logs(self) -> None:
        self.records.reopen()

    def configure(self, config: Config) -> None:
        """A reload's swap: the dispatcher takes the new timeouts, limits and retries."""
        if self.dispatcher is not None:
            self.dispatcher.configure(config)
