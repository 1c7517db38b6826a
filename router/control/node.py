"""What every process of a router holds, whatever its role.

A `Node` has the config and the ways it changes (reload, admin edits, discovery), the
fleet and its policy, the health checks and model polls, the metrics and the telemetry
loops. The two roles add their own parts to it: `Router` (router/control/worker.py) the
listeners and the request path, `Collector` (router/control/collector.py) the feed to
the workers. Reload, the admin API and discovery see a node through their own narrow
interfaces (`Reloadable`, `AdminHost`, `DiscoveryHost`).
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable

import aiohttp
import orjson

from router import log
from router.config import Config, ConfigError, KvEventsConfig
from router.context import WorkerContext
from router.control.admin import apply_edit
from router.control.reload import ConfigSource, Reloader, check_admin_token, policy_for
from router.control.tls import ServingTls
from router.fleet.backends import Backend, Fleet
from router.fleet.discovery import Discovery
from router.fleet.health import HealthChecker, ModelPoller, Verdicts
from router.fleet.placements import PlacementTable
from router.fleet.pools import pool_states
from router.fleet.shared_load import LoadTable
from router.ingress.auth import AdminToken, Authenticator
from router.metrics import Metrics
from router.telemetry.loops import Parts, Telemetry
from router.upstream.pages import Pages
from router.upstream.proxy import make_session

STARTUP_POLL_SECONDS = 3.0


class Node(ABC):
    """The parts both roles are composed of; `start_parts` starts them, `stop_parts`
    stops them (the role stops its own parts first)."""

    def __init__(
        self,
        config: Config,
        source: ConfigSource | None,
        context: WorkerContext | None,
        table: LoadTable | None = None,
        placements: PlacementTable | None = None,
    ) -> None:
        """Build the parts; ConfigError if a secret the config names cannot be read."""
        self.config = config
        self.context = context
        routing = policy_for(config, context)
        self.fleet = Fleet(
            config.backends, routing, config.breaker, table, placements, config.backend_defaults
        )
        self.fleet.set_pools(config.pools)
        self.auth = Authenticator(config.auth)
        self.admin_token = None if config.admin is None else AdminToken(config.admin)
        check_admin_token(self.admin_token, self.auth)
        self.tls = ServingTls()  # none: a Router (worker.py) loads its listeners'
        self.reloader = Reloader(self, source)  # SIGHUP and the admin API
        self.discovery = Discovery(self)  # backends from DNS names
        self.metrics = Metrics(
            lambda: self.fleet.members,
            context is not None,
            config.metrics.tenants,
            lambda: pool_states(self.fleet),
            lambda: self.auth.tenants,
        )
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        self._pages: Pages | None = None
        self.telemetry: Telemetry | None = None
        self._edits: set[asyncio.Task] = set()  # admin edits broadcast by worker 0

    def _kv_events(self) -> dict[str, KvEventsConfig]:
        """Each backend's KV event endpoints in the current (possibly reloaded) config."""
        return {b.key: b.kv_events for b in self.config.backends if b.kv_events is not None}

    def start_parts(self) -> None:
        """The backend-facing parts: the client session (the request path's calls beside
        the proxy: /tokenize, adapters), the GETs of health checks, model polls and
        scrapes (router/upstream/pages.py), and the telemetry loops (scraping and KV
        events, or the collector's feed)."""
        cfg = self.config
        self._session = make_session(cfg.timeouts.connect)
        self._pages = Pages(cfg.timeouts.connect)
        self.poller = ModelPoller(
            self.fleet, self._pages.ask, cfg.models_refresh_interval, STARTUP_POLL_SECONDS
        )
        self.health = HealthChecker(self.fleet, self._pages.ask, cfg.health)
        self.verdicts = Verdicts(self.fleet, self.health)
        parts = Parts(self.fleet, self._pages.get, self.metrics, cfg.telemetry, self._kv_events)
        self.telemetry = self._telemetry(parts)
        self.telemetry.start()

    @abstractmethod
    def _telemetry(self, parts: Parts) -> Telemetry:
        """This role's telemetry loops (see router/telemetry/loops.py)."""

    def run_discovery(self) -> None:
        """The discovery sources, run once for the router (here)."""
        self._tasks.append(asyncio.create_task(self.discovery.run(), name="kvroute-dns"))

    async def probe(self, after: Callable[[], None] | None) -> None:
        """One model poll and one health check before serving, so /ready and the first
        requests see which backends answer (bounded: a slow backend stays "up"); then
        the periodic rounds, each followed by `after` (the collector's publish)."""
        members = list(self.fleet.members)
        startup = asyncio.gather(self.poller.poll_once(), self.health.admit(members))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(startup, STARTUP_POLL_SECONDS)
        if down := self.health.failing(members):
            log.backends.warning(
                "%d of %d backends fail their health check at start, no requests go to "
                "them until they pass: %s",
                len(down),
                len(members),
                ", ".join(down),
            )
        if after is not None:
            after()
        self._tasks.append(asyncio.create_task(self.poller.run(after), name="kvroute-models"))
        self._tasks.append(asyncio.create_task(self.health.run(after), name="kvroute-health"))

    async def stop_parts(self) -> None:
        if self.telemetry is not None:
            await self.telemetry.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self._pages is not None:
            self._pages.close()

    async def admit(self, added: list[Backend], everywhere: bool) -> None:
        """Health and models of backends about to join (reload, admin API, discovery),
        checked here."""
        await asyncio.gather(self.health.admit(added), self.poller.poll(added))

    @abstractmethod
    def configure(self, config: Config) -> None:
        """A reload's swap: the request path takes `config` (never awaits)."""

    def hangup(self) -> None:
        """SIGHUP: the log files opened anew (logrotate moved them), then a reload."""
        self.reopen_logs()
        self.reloader.reload_soon()

    @abstractmethod
    def reopen_logs(self) -> None:
        """The files this process writes logs to, opened anew."""

    @abstractmethod
    def admitted(self) -> None:
        """Backends joined the fleet."""

    async def rediscover(self) -> None:
        """The discovered backends changed: apply the config with them."""
        await self.reloader.apply(self.config)

    def _edited(self, payload: bytes) -> None:
        """An admin edit broadcast by worker 0 (router/control/admin.py), applied here."""
        task = asyncio.create_task(self._apply_edit(orjson.loads(payload)))
        self._edits.add(task)
        task.add_done_callback(self._edits.discard)

    async def _apply_edit(self, edit: dict) -> None:
        try:
            await apply_edit(self, edit, everywhere=True)
        except ConfigError as exc:  # worker 0 validated it: only a local secret can fail
            log.config.error("admin edit from worker 0 refused: %s", exc)
