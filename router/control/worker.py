"""A worker: the request path of one process, and, on its own, a whole router.

`Router` runs its request path (router/control/request_path.py): the listeners (HTTP
with its fast path, gRPC, the admin API in worker 0) over one `Dispatcher`. As one of
several workers (router/control/supervisor.py) it shares in-flight counts, admission
counts and placements with the others through the run directory's tables
(shared_tables.py), and takes its telemetry, health verdicts, model lists and
discovered backends from the collector's feed (joining.py). Alone (`--workers 1`, or in
tests) it does that upkeep itself: its telemetry runs in-process."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from router import log
from router.config import Config
from router.context import WorkerContext
from router.control.admin import AdminServer
from router.control.joining import join_collector, unjudged
from router.control.metrics_relay import CountedClient
from router.control.node import Node
from router.control.reload import ConfigSource
from router.control.request_path import RequestPath
from router.control.shared_tables import SharedTables
from router.control.tls import ServingTls
from router.dispatch.dispatcher import Dispatcher
from router.fleet.backends import Backend
from router.fleet.health import REFUSED
from router.ingress.web import HttpIngress
from router.jobs.runner import JobRunner
from router.telemetry.loops import LocalTelemetry, Parts, Telemetry
from router.telemetry.worker_feed import WorkerTelemetry


class Router(Node):
    """One router process that serves: a node, its request path, the shared tables."""

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
        self.shared = SharedTables.open(context, self._share, config.cluster is not None)
        super().__init__(config, source, context, self.shared.load, self.shared.placements)
        self.tls = ServingTls.load(config)
        self.admin = None
        if self.admin_token is not None and (context is None or context.index == 0):
            self.admin = AdminServer(self, config.admin, self.admin_token)
        self.path = RequestPath(config, context, self.admin, self.tls, span_exporter)
        self._counted = None if context is None else CountedClient(context.metrics_socket)
        self.metrics.counted_elsewhere = self._counted
        self.ingress: HttpIngress | None = None
        self.port = self.grpc_port = 0
        self._runner: web.AppRunner | None = None  # the aiohttp app's (its routes)

    @property
    def dispatcher(self) -> Dispatcher | None:
        return self.path.dispatcher

    @property
    def jobs(self) -> JobRunner | None:
        """Async jobs and batches, when `jobs.enabled`."""
        return self.path.jobs

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
            if self.context is None:  # alone: discovery and the first probe round here
                self.run_discovery()
                await self.probe(None)
            else:
                await join_collector(self.telemetry, self.verdicts, self._edits)
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

    async def _serve(self) -> None:
        """The request path, on the config replayed edits may have changed."""
        self._tasks.append(asyncio.create_task(self.metrics.watch_loop_lag(), name="kvroute-lag"))
        await self.path.open(self, self._session, self._refused, self.shared.admission)
        lst = self.path.listeners
        self.ingress, self._runner = lst.ingress, lst.runner
        self.port, self.grpc_port = lst.port, lst.grpc_port

    async def stop(self) -> None:
        """The request path drains and closes (router/control/request_path.py), then
        the node's parts stop and the shared tables close."""
        await self.path.close(self.config.shutdown.drain_seconds)
        await self.stop_parts()
        if self._counted is not None:
            await self._counted.close()
        self.shared.close()

    async def shutdown(self) -> None:
        """Graceful stop: /ready turns 503 first; after `shutdown.unready_seconds` the
        listeners close, and requests in flight get `shutdown.drain_seconds` to end;
        those still open then end with a "shutting down" error."""
        await self.path.unready(self.config.shutdown.unready_seconds)
        await self.stop()

    async def admit(self, added: list[Backend], everywhere: bool) -> None:
        """Health and models of backends about to join (reload, admin API, discovery).

        A worker of several whose change the collector applies too (`everywhere`: a
        SIGHUP, an edit broadcast by worker 0, discovered backends) takes the
        collector's verdicts, so each backend is checked once for the router; it checks
        itself only the ones the collector said nothing of in time.
        """
        if everywhere and self.context is not None:
            added = await unjudged(self.verdicts, added, self.config.health.timeout)
        if added:
            await super().admit(added, everywhere)

    def admitted(self) -> None:
        """Nothing to tell: only the collector feeds other processes."""

    def reopen_logs(self) -> None:
        self.path.records.reopen()

    def configure(self, config: Config) -> None:
        self.path.configure(config)
