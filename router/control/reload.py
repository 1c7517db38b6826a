"""Hot reload: build, validate, swap (STYLE.md §6).

`Reloader.reload()` (SIGHUP, `POST /admin/reload`) re-reads the YAML file with the
command line's overrides applied again; `apply(config)` (also behind the admin API's
add and remove) does the rest:

1. build: the policy (the running one when `routing:` is unchanged, so whatever it
   learned survives; its `on_fleet_change` rebuilds the ring, and consistent hashing
   keeps the prefixes of unchanged backends where they were), the auth secrets, and
   a Backend for each added one, checked once and asked for its models (bounded by
   `health.timeout`), so it joins with known health and models (`Router.admit`: in a
   worker of several, the collector checks it for the router when it applies the same
   change, a SIGHUP or a broadcast edit, and the worker takes its verdict);
2. validate: any error (unreadable file, bad field, missing secret) raises
   ConfigError before anything changed; the old config keeps serving;
3. swap, with no await: fleet membership and policy (`Fleet.update`: unchanged
   backends keep their object, in-flight count and health; removed ones get no new
   requests and finish the ones they have), dispatcher, health and auth settings, the
   listeners' certificates, and finally `Router.config`, the effective config the
   admin API shows.

Only the sections in `_LIVE` (and the admission limits) change on reload; the rest
is bound to sockets or loops started once (listen, admin, grpc, shutdown, telemetry,
header and body limits, ...), so it is kept from the running config and logged as
"at restart". The listeners' certificates are the exception: a reload from the file
(`reload()`, not an admin edit or a discovery change) reads `listen.tls` and
`grpc.tls` again, the same paths or new ones, and new connections get the new pair
(router/control/tls.py); a pair that does not load rejects the reload. Turning TLS
on or off for a listener waits for a restart ("listen.tls and grpc.tls (TLS on or
off)" in the log). A lock serializes reloads, so an admin call and a SIGHUP never
interleave between build and swap.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

import policies
from router import log
from router.config import Config, ConfigError, load
from router.context import WorkerContext
from router.control.shared_tables import share_index
from router.control.tls import ServingTls, serving_tls
from router.fleet.backends import Backend, Fleet
from router.fleet.discovery import Discovery
from router.fleet.health import HealthChecker
from router.ingress.auth import AdminToken, Authenticator

#: top-level sections a reload applies; every other one waits for a restart
_LIVE = frozenset(
    {
        "backends",
        "pools",
        "routing",
        "timeouts",
        "limits",
        "flow",
        "health",
        "breaker",
        "retries",
        "auth",
    }
)
#: limits read by the HTTP server at start (aiohttp handler settings, app body limit)
_LIMITS_AT_RESTART = (
    "max_body_bytes",
    "max_header_bytes",
    "max_headers",
    "header_timeout",
    "body_timeout",
)


@dataclass(frozen=True)
class ConfigSource:
    """Where the config came from: a YAML file (or none) and command-line overrides."""

    path: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)

    def load(self) -> Config:
        return load(self.path, self.overrides)


class Reloadable(Protocol):
    """What a reload swaps in a router process: its config, fleet, health and auth
    settings, and (`configure`) whatever its request path reads of the config."""

    config: Config
    context: WorkerContext | None
    fleet: Fleet
    discovery: Discovery
    health: HealthChecker
    auth: Authenticator
    admin_token: AdminToken | None
    tls: ServingTls

    async def admit(self, added: list[Backend], everywhere: bool) -> None:
        """Health and models of backends about to join."""

    def configure(self, config: Config) -> None:
        """The request path takes `config` (the swap: never awaits)."""

    def admitted(self) -> None:
        """Backends joined the fleet."""


class Reloader:
    def __init__(self, router: Reloadable, source: ConfigSource | None) -> None:
        self._router = router
        self._source = source
        self._lock = asyncio.Lock()
        self._pending: set[asyncio.Task] = set()

    def reload_soon(self) -> None:
        """SIGHUP: reload in the background; a rejected config is logged, not raised.
        Every process of the router gets the signal, so the collector checks the
        backends it adds (see `Router.admit`)."""
        task = asyncio.get_running_loop().create_task(self._reload_quietly())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _reload_quietly(self) -> None:
        with contextlib.suppress(ConfigError):  # reload() logged why
            await self.reload(everywhere=True)

    async def reload(self, everywhere: bool = False) -> dict[str, list[str]]:
        """Re-read the config file and apply it; ConfigError (logged) leaves all as is.
        `everywhere`: the collector applies it too (see `apply`)."""
        if self._source is None:
            raise ConfigError("the router was started without a config to reload")
        try:
            config = self._source.load()
        except ConfigError as exc:
            log.config.error("reload rejected, the old config keeps serving: %s", exc)
            raise
        return await self.apply(config, everywhere, renew=True)

    async def apply(
        self, config: Config, everywhere: bool = False, renew: bool = False
    ) -> dict[str, list[str]]:
        """Build, validate and swap in `config`; returns what changed, by kind.
        `everywhere`: the collector applies the same change, so in a worker the added
        backends take its health checks instead of checks of their own. `renew`: read
        the listeners' certificates again (a reload from the file)."""
        async with self._lock:
            try:
                return await self._apply(config, everywhere, renew)
            except ConfigError as exc:
                log.config.error("reload rejected, the old config keeps serving: %s", exc)
                raise

    async def _apply(self, new: Config, everywhere: bool, renew: bool) -> dict[str, list[str]]:
        router = self._router
        new = router.discovery.merge(new)  # DNS-discovered backends join every config
        old = router.config
        new, at_restart = _pin_restart_only(old, new)
        fleet = router.fleet
        policy = fleet.policy if new.routing == old.routing else policy_for(new, router.context)
        auth = Authenticator(new.auth)
        check_admin_token(router.admin_token, auth)
        certificates = router.tls.renewal(new) if renew else _no_renewal
        backends = fleet.prepare(new.backends, new.breaker, new.backend_defaults)
        current = {id(b) for b in fleet.members}
        added = [b for b in backends if id(b) not in current]
        if added:
            try:
                await router.admit(added, everywhere)
            except BaseException:  # e.g. cancelled at shutdown: they never join
                fleet.let_go(added)
                raise
        # swap: no await from here on
        kept = {id(b) for b in backends}
        removed = [b.name for b in fleet.members if id(b) not in kept]
        fleet.update(new.backends, backends, policy, new.breaker, new.pools)
        router.configure(new)
        router.health.cfg = new.health
        router.auth.adopt(auth)
        certificates()
        router.config = new
        if added:
            router.admitted()
        report = {
            "added": [b.name for b in added],
            "removed": removed,
            "at_restart": at_restart,
        }
        log.config.info(
            "config reloaded: %s (added %s, removed %s)%s",
            log.counted(len(backends), "backend"),
            report["added"] or "none",
            removed or "none",
            f"; changes to {', '.join(at_restart)} apply at restart" if at_restart else "",
        )
        return report


def policy_for(config: Config, context: WorkerContext | None) -> policies.Policy:
    """The config's routing policy, its index shared by the host's processes when there
    are several (`share_index`)."""
    try:
        policy = policies.create(config.routing)
    except (OSError, ValueError) as exc:  # e.g. a tokenizer file that cannot be loaded
        raise ConfigError(f"routing: {exc}") from exc
    share_index(policy, context)
    return policy


def check_admin_token(admin: AdminToken | None, auth: Authenticator) -> None:
    """Refuse an admin token that is also a data-plane token (it would open both)."""
    if admin is not None and auth.knows(admin.token):
        raise ConfigError("the admin token must not also be a data-plane token")


def _no_renewal() -> None:
    """An admin edit or a discovery change: the certificates stay as they are."""


def _pin_restart_only(old: Config, new: Config) -> tuple[Config, list[str]]:
    """`new` with the sections a reload cannot apply taken from `old`, and their names.
    `listen.tls` and `grpc.tls` are live unless they turn a listener's TLS on or off."""
    replace = msgspec.structs.replace
    switched = _tls_switched(old, new)
    if not switched:  # compare the rest of listen and grpc; the new certificates are kept
        old = replace(
            old,
            listen=replace(old.listen, tls=new.listen.tls),
            grpc=replace(old.grpc, tls=new.grpc.tls),
        )
    pinned = {
        name: getattr(old, name)
        for name in new.__struct_fields__
        if name not in _LIVE and getattr(new, name) != getattr(old, name)
    }
    limits = {
        name: getattr(old.limits, name)
        for name in _LIMITS_AT_RESTART
        if getattr(new.limits, name) != getattr(old.limits, name)
    }
    changed = [*pinned, *(f"limits.{name}" for name in limits)]
    if switched:
        changed.append("listen.tls and grpc.tls (TLS on or off)")
    if limits:
        pinned["limits"] = replace(new.limits, **limits)
    return (replace(new, **pinned) if pinned else new), changed


def _tls_switched(old: Config, new: Config) -> bool:
    """Whether `new` turns TLS on or off for a listener that runs under both (its
    socket was made at start); gRPC turned on or off is a change of its own."""
    (old_http, old_grpc), (new_http, new_grpc) = serving_tls(old), serving_tls(new)
    if (old_http is None) != (new_http is None):
        return True
    both = old.grpc.enabled and new.grpc.enabled
    return both and (old_grpc is None) != (new_grpc is None)
