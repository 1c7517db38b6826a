"""A worker's listeners: HTTP (its fast path in front of aiohttp's server), the admin
API (worker 0 only) and gRPC, all over one dispatcher, started together and drained
together; HTTP and gRPC over TLS when the config names certificates (tls.py)."""

from __future__ import annotations

from collections.abc import Awaitable

from aiohttp import web

from router.config import Config
from router.context import WorkerContext
from router.control.admin import AdminServer
from router.control.tls import ServingTls
from router.dispatch.dispatcher import CUT_GRACE_SECONDS, Dispatcher
from router.errors import listening
from router.fleet.backends import Fleet
from router.ingress.auth import AdminToken, Authenticator
from router.ingress.fast import FastConnections, FastSite
from router.ingress.grpc_service import GrpcIngress
from router.ingress.web import (
    HttpIngress,
    connection_handler,
    errors_middleware,
    no_server_header,
    parser_limits,
    server_limits,
)
from router.jobs.runner import JobRunner
from router.metrics import Metrics
from router.telemetry.loops import Telemetry


class Listeners:
    def __init__(
        self, context: WorkerContext | None, admin: AdminServer | None, tls: ServingTls
    ) -> None:
        #: one of several workers: they share the ports (SO_REUSEPORT) and the budgets
        self._shared = context is not None
        self._workers = 1 if context is None else context.workers
        self.admin = admin
        self._tls = tls
        self.port = 0
        self.grpc_port = 0
        self.ingress: HttpIngress | None = None
        self.runner: web.AppRunner | None = None  # aiohttp's, behind the fast path
        self._grpc: GrpcIngress | None = None

    async def start(
        self,
        cfg: Config,
        fleet: Fleet,
        dispatcher: Dispatcher,
        metrics: Metrics,
        auth: Authenticator,
        telemetry: Telemetry,
        admin_token: AdminToken | None,
        jobs: JobRunner | None = None,
    ) -> None:
        """HTTP (its fast path first), then the admin API and gRPC."""
        self.ingress = HttpIngress(
            cfg, fleet, dispatcher, metrics, auth, telemetry, admin_token, self._workers, jobs
        )
        await self._listen_http(cfg)
        if self.admin is not None:
            with listening("the admin API", cfg.admin.host, cfg.admin.port):
                await self.admin.start()
        if cfg.grpc.enabled:  # same loop, same dispatcher, its own port
            rpc_tls = self._tls.grpc
            credentials = None if rpc_tls is None else rpc_tls.credentials
            self._grpc = GrpcIngress(
                cfg, fleet, dispatcher, metrics, auth, self._shared, credentials
            )
            with listening("gRPC", cfg.grpc.host or cfg.listen.host, cfg.grpc.port):
                self.grpc_port = await self._grpc.start()

    async def _listen_http(self, cfg: Config) -> None:
        app = web.Application(
            client_max_size=cfg.limits.max_body_bytes,
            middlewares=[self.ingress.unrouted, errors_middleware],
        )
        app.on_response_prepare.append(no_server_header)
        app.add_routes(self.ingress.routes())
        self.runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            # the dispatcher cuts what is left at drain_seconds: this outlasts its ending
            shutdown_timeout=cfg.shutdown.drain_seconds + CUT_GRACE_SECONDS,
            **server_limits(cfg.limits),
        )
        await self.runner.setup()
        fast = FastConnections(
            self.ingress,
            connection_handler(self.runner.server, cfg.limits),
            cfg.limits.max_body_bytes,
            cfg.limits.body_timeout,
            cfg.limits.header_timeout,
            parser_limits(cfg.limits),
        )
        site = FastSite(
            self.runner,
            fast,
            host=cfg.listen.host,
            port=cfg.listen.port,
            reuse_address=True,
            reuse_port=self._shared,
            backlog=cfg.listen.backlog,
            ssl_context=None if self._tls.http is None else self._tls.http.context,
        )
        with listening("HTTP", cfg.listen.host, cfg.listen.port):
            await site.start()
        self.port = self.runner.addresses[0][1]

    def closing(self, drain_seconds: float) -> list[Awaitable[None]]:
        """Stop taking connections and RPCs; what is in flight on gRPC gets
        `drain_seconds` (and the dispatcher's cut) to end."""
        steps: list[Awaitable[None]] = []
        if self._grpc is not None:
            steps.append(self._grpc.stop(drain_seconds + CUT_GRACE_SECONDS))
        if self.runner is not None:
            steps.append(self.runner.cleanup())
        return steps

    async def stop_admin(self) -> None:
        if self.admin is not None:
            await self.admin.stop()
