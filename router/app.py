"""Wiring: build the pieces from a Config, start them in order, stop them in reverse."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Callable

import aiohttp
import orjson
from aiohttp import web

import policies
from router import log
from router.admin import AdminServer, apply_edit, discovered_edit, replay_edits
from router.auth import AdminToken, Authenticator
from router.backends import Backend, Fleet
from router.config import Config, ConfigError, KvEventsConfig
from router.discovery import Discovery
from router.dispatch import CUT_GRACE_SECONDS, Dispatcher
from router.errors import listening
from router.fast_ingress import FastConnections, FastSite
from router.grpc_ingress import GrpcIngress
from router.health import REFUSED, HealthChecker, ModelPoller, Verdicts
from router.http_ingress import (
    HttpIngress,
    connection_handler,
    errors_middleware,
    no_server_header,
    parser_limits,
    server_limits,
)
from router.metrics import Metrics
from router.placements import PlacementTable
from router.proxy import make_session
from router.reload import ConfigSource, Reloader, check_admin_token
from router.shared_admission import AdmissionTable
from router.shared_load import LoadTable
from router.telemetry import Telemetry
from router.workers import WorkerContext

_STARTUP_POLL_SECONDS = 3.0
_FEED_JOIN_SECONDS = 10.0  # a worker waits this long for the collector's feed to be live
_VERDICT_GRACE = 1.0  # beyond the collector's own admission checks, before checking itself


class Router:
    """One router instance: HTTP listener, backend fleet, policy, metrics, loops.

    With `context` it is one process of a multi-process router (router/workers.py): a
    worker (shared load table, telemetry from the collector, SO_REUSEPORT listener, the
    admin API in worker 0 only) or the collector (telemetry and discovery, no listener).
    """

    def __init__(
        self,
        config: Config,
        source: ConfigSource | None = None,
        context: WorkerContext | None = None,
    ) -> None:
        """Build the pieces; ConfigError if a secret the config names cannot be read."""
        self.config = config
        self.context = context
        self.table = None
        self.placements = None
        self.admission_counts = None
        if context is not None and not context.collector:
            ctx = context
            self.table = LoadTable(ctx.table_path, ctx.slots, ctx.workers, ctx.index)
            self.placements = PlacementTable(ctx.placements_path, ctx.index, self._share)
            self.admission_counts = AdmissionTable(ctx.admission_path, ctx.workers, ctx.index)
        routing = policies.create(config.routing)
        self.fleet = Fleet(config.backends, routing, config.breaker, self.table, self.placements)
        self.auth = Authenticator(config.auth)
        self.admin_token = None if config.admin is None else AdminToken(config.admin)
        check_admin_token(self.admin_token, self.auth)
        serves_admin = context is None or context.index == 0
        self.admin = None
        if self.admin_token is not None and serves_admin:
            self.admin = AdminServer(self, config.admin, self.admin_token)
        self.reloader = Reloader(self, source)  # SIGHUP and the admin API
        self.discovery = Discovery(self)  # backends from DNS names
        self.metrics = Metrics(
            lambda: self.fleet.members, context is not None, config.metrics.tenants
        )
        self.port = 0
        self._runner: web.AppRunner | None = None
        self.grpc: GrpcIngress | None = None  # gRPC ingress, when config.grpc.enabled
        self.grpc_port = 0
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        self.telemetry: Telemetry | None = None
        self.dispatcher: Dispatcher | None = None  # none in the collector
        self.ingress: HttpIngress | None = None  # the HTTP ingress (none in the collector)
        self._edits: set[asyncio.Task] = set()  # admin edits broadcast by worker 0

    def _share(self, payload: bytes) -> None:
        """This worker's placements, to the others (dropped before telemetry starts)."""
        if self.telemetry is not None:
            self.telemetry.push_nowait(payload)

    def _refused(self, backend: Backend) -> None:
        """A connection to `backend` was refused: down here at once, and with several
        workers in the collector too, which tells every worker (router/health.py)."""
        if self.health.refused(backend) and self.telemetry is not None:
            self.telemetry.push_nowait(REFUSED + backend.name.encode())

    def _kv_events(self) -> dict[str, KvEventsConfig]:
        """Each backend's KV event endpoints in the current (possibly reloaded) config."""
        return {b.key: b.kv_events for b in self.config.backends if b.kv_events is not None}

    @property
    def url(self) -> str:
        return f"http://{self.config.listen.host}:{self.port}"

    async def start(self) -> None:
        """Start in order; on any failure, stop what started and re-raise."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        cfg = self.config
        self._session = make_session(cfg.timeouts.connect)
        self.poller = ModelPoller(
            self.fleet, self._session, cfg.models_refresh_interval, _STARTUP_POLL_SECONDS
        )
        self.health = HealthChecker(self.fleet, self._session, cfg.health)
        # backend telemetry: /metrics scraping and KV event subscriptions; with
        # several workers, gathered once by the collector and fed to the workers, as are
        # the health verdicts, model lists and discovered backends
        ctx = self.context
        worker = self._is_worker()
        if not worker:
            self._tasks.append(asyncio.create_task(self.discovery.run(), name="kvroute-dns"))
        self.verdicts = verdicts = Verdicts(self.fleet, self.health)
        self.telemetry = Telemetry(
            self.fleet,
            self._session,
            self.metrics,
            cfg.telemetry,
            self._kv_events,
            ctx,
            self._edited,
            verdicts,
            lambda: replay_edits(self),
        )
        self.telemetry.start()
        if worker:
            if not await self.telemetry.joined(_FEED_JOIN_SECONDS):
                log.server.warning("the collector's feed is not live yet: edits may be missed")
            # the collector's first round is bounded; the edits it replays came before
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(verdicts.adopted.wait(), 2 * _STARTUP_POLL_SECONDS)
            if self._edits:  # applied before serving (not cancelled if slow)
                await asyncio.wait(self._edits, timeout=_STARTUP_POLL_SECONDS)
        else:
            await self._probe(None if ctx is None else self.telemetry.publish_verdicts)
        if ctx is not None and ctx.collector:
            return
        self.fleet.changed()
        cfg = self.config  # replayed edits may have changed it
        self.dispatcher = Dispatcher(
            cfg, self.fleet, self.metrics, self._session, self._refused, self.admission_counts
        )
        self._tasks.append(asyncio.create_task(self.metrics.watch_loop_lag(), name="kvroute-lag"))
        app = web.Application(
            client_max_size=cfg.limits.max_body_bytes, middlewares=[errors_middleware]
        )
        app.on_response_prepare.append(no_server_header)
        workers = ctx.workers if ctx is not None else 1
        self.ingress = ingress = HttpIngress(
            cfg,
            self.fleet,
            self.dispatcher,
            self.metrics,
            self.auth,
            self.telemetry,
            self.admin_token,
            workers,
        )
        app.add_routes(ingress.routes())
        self._runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            # the dispatcher cuts what is left at drain_seconds: this outlasts its ending
            shutdown_timeout=cfg.shutdown.drain_seconds + CUT_GRACE_SECONDS,
            **server_limits(cfg.limits),
        )
        await self._runner.setup()
        fast = FastConnections(
            ingress,
            connection_handler(self._runner.server, cfg.limits),
            cfg.limits.max_body_bytes,
            cfg.limits.body_timeout,
            cfg.limits.header_timeout,
            parser_limits(cfg.limits),
        )
        site = FastSite(
            self._runner,
            fast,
            host=cfg.listen.host,
            port=cfg.listen.port,
            reuse_address=True,
            reuse_port=ctx is not None,  # the workers share the port
            backlog=cfg.listen.backlog,
        )
        with listening("HTTP", cfg.listen.host, cfg.listen.port):
            await site.start()
        self.port = self._runner.addresses[0][1]
        if self.admin is not None:
            with listening("the admin API", cfg.admin.host, cfg.admin.port):
                await self.admin.start()
        # gRPC ingress: same loop, same dispatcher, its own port
        if cfg.grpc.enabled:
            self.grpc = GrpcIngress(
                cfg, self.fleet, self.dispatcher, self.metrics, self.auth, ctx is not None
            )
            with listening("gRPC", cfg.grpc.host or cfg.listen.host, cfg.grpc.port):
                self.grpc_port = await self.grpc.start()
        log.server.info(
            "kvroute listening on %s, strategy %s, %d backends",
            self.url,
            self.dispatcher.strategy,
            len(self.fleet.members),
        )

    async def stop(self) -> None:
        await self._drain()
        if self.telemetry is not None:
            await self.telemetry.stop()
        if self.admin is not None:
            await self.admin.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.dispatcher is not None:
            self.dispatcher.close()  # idle upstream connections
        if self._session is not None:
            await self._session.close()
        if self.table is not None:
            self.table.close()
        if self.placements is not None:
            self.placements.close()
        if self.admission_counts is not None:
            self.admission_counts.close()

    async def _drain(self) -> None:
        """Both listeners stop taking connections and RPCs at once; the requests in
        flight on either get `shutdown.drain_seconds` to end together, then the
        dispatcher ends each one left with a "shutting down" error, and the servers
        close what remains."""
        drain = self.config.shutdown.drain_seconds
        steps = []
        if self.grpc is not None:
            steps.append(self.grpc.stop(drain + CUT_GRACE_SECONDS))
        if self._runner is not None:
            steps.append(self._runner.cleanup())
        if self.dispatcher is not None:
            steps.append(self.dispatcher.drain(drain))
        await asyncio.gather(*steps)

    async def _probe(self, after: Callable[[], None] | None) -> None:
        """One model poll and one health check before serving, so /ready and the first
        requests see which backends answer (bounded: a slow backend stays "up"); then
        the periodic rounds, each followed by `after` (the collector's publish)."""
        members = list(self.fleet.members)
        startup = asyncio.gather(self.poller.poll_once(), self.health.admit(members))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(startup, _STARTUP_POLL_SECONDS)
        if after is not None:
            after()
        self._tasks.append(asyncio.create_task(self.poller.run(after), name="kvroute-models"))
        self._tasks.append(asyncio.create_task(self.health.run(after), name="kvroute-health"))

    def _is_worker(self) -> bool:
        return self.context is not None and not self.context.collector

    async def admit(self, added: list[Backend], everywhere: bool) -> None:
        """Health and models of backends about to join (reload, admin API, discovery).

        A worker of several whose change the collector applies too (`everywhere`: a
        SIGHUP, an edit broadcast by worker 0, discovered backends) takes the
        collector's verdicts, so each backend is checked once for the router; it checks
        itself only the ones the collector said nothing of in time.
        """
        if everywhere and self._is_worker():
            wait = max(self.config.health.timeout, _STARTUP_POLL_SECONDS) + _VERDICT_GRACE
            added = await self.verdicts.take(added, wait)
        if added:
            await asyncio.gather(self.health.admit(added), self.poller.poll(added))

    def admitted(self) -> None:
        """Backends joined the fleet: the collector tells the workers their verdicts."""
        if (feed := self._collecting()) is not None:
            feed.verdicts_changed()

    def discovered(self) -> None:
        """The discovered backends changed here: the collector hands them to the workers
        (discovery runs once for the router, so every worker routes over one fleet)."""
        if (feed := self._collecting()) is not None:
            feed.announce(discovered_edit(self))

    def _collecting(self) -> Telemetry | None:
        """The feed to the workers, when this process is the collector of several."""
        ctx = self.context
        return self.telemetry if ctx is not None and ctx.collector else None

    def _edited(self, payload: bytes) -> None:
        """An admin edit broadcast by worker 0 (router/admin.py), applied here too."""
        task = asyncio.create_task(self._apply_edit(orjson.loads(payload)))
        self._edits.add(task)
        task.add_done_callback(self._edits.discard)

    async def _apply_edit(self, edit: dict) -> None:
        try:
            await apply_edit(self, edit, everywhere=True)
        except ConfigError as exc:  # worker 0 validated it: only a local secret can fail
            log.config.error("admin edit from worker 0 refused: %s", exc)

    async def shutdown(self) -> None:
        """Graceful stop: /ready turns 503 first; after `shutdown.unready_seconds` the
        listeners close, and requests in flight get `shutdown.drain_seconds` to end;
        those still open then end with a "shutting down" error (`_drain`)."""
        if self.dispatcher is not None:  # the collector serves nothing: it just stops
            self.dispatcher.draining = True
            await asyncio.sleep(self.config.shutdown.unready_seconds)
        await self.stop()


async def serve(
    config: Config, source: ConfigSource | None = None, context: WorkerContext | None = None
) -> None:
    """Run until SIGINT or SIGTERM, then drain (Router.shutdown); SIGHUP reloads."""
    router = Router(config, source, context)
    await router.start()
    # what start-up built lives until exit: keep it out of the collector's scans, and
    # collect the young generation less often (GC was ~10% of CPU at concurrency 64)
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, router.reloader.reload_soon)
    try:
        await stop.wait()
    finally:
        log.server.info("shutting down: draining for up to %gs", config.shutdown.drain_seconds)
        await router.shutdown()
