"""The admin API: its own aiohttp listener (loopback by default) and its own token.

Every route needs `Authorization: Bearer <admin token>` (read from `admin.token_file`
or `admin.token_env`, compared in constant time; auth.py `AdminToken`), but the
scraper's `/metrics`. Data-plane tokens never open it: they are checked against the
admin token only, and a config in which the admin token is also a data-plane token is
refused at start and on reload. With auth on, the same token opens the data port's
`/debug/routing`.

  GET    /admin/backends               every backend: url, weight, models, state
                                       (active | draining | retiring), health check
                                       verdict and age of the last pass, breaker
                                       state, usable, in-flight requests
  POST   /admin/backends               add one: {"url", "name"?, "weight"?, "models"?}
  DELETE /admin/backends/{name}        remove one: no new requests, in-flight ones end
  POST   /admin/backends/{name}/drain  no new requests, but it keeps its place on the
                                       hash ring, so `undrain` brings its prefixes back
  POST   /admin/backends/{name}/undrain
  GET    /admin/pools                  each pool, preferred first: backends, usable,
                                       in flight, saturation, and the backends wanted
                                       and removable without losing capacity
                                       (fallbacks first: router/fleet/pools.py); empty
                                       for a flat fleet
  GET    /admin/usage                  the usage records (config usage.records) summed
                                       by tenant, model and pool: ?since=&until= (epoch
                                       seconds or ISO 8601, UTC if no zone) and ?tenant=
  GET    /admin/config                 the effective config (it names where secrets
                                       are read from, never the secrets)
  POST   /admin/reload                 re-read the config file, as SIGHUP does
  GET    /metrics                      with `metrics: {listen: admin}` only, and the one
                                       route open without the token: the scraper's, the
                                       same router-wide page the data port would show

Add and remove edit the effective config and go through the same build, validate and
swap as a reload (reload.py); a later reload from the file brings back the file's
list. Drain is runtime state: it survives reloads while the backend stays configured.

With several workers (router/control/supervisor.py) the admin API listens in worker 0 only. Its
reads describe worker 0's view (in-flight counts are router-wide); `reload` reloads
worker 0 and, when the file was valid, asks the supervisor to reload every process.
Add, remove, drain and undrain are applied in worker 0 first (so a bad edit answers
400 and changes nothing), then broadcast through the collector to every worker, which
applies the same edit with `apply_edit` (worker 0 gets it back: applying it twice
changes nothing).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Protocol

import msgspec
import orjson
from aiohttp import web

from router import usage_records
from router.config import AdminConfig, Config, ConfigError, build
from router.control.reload import Reloader
from router.errors import BadRequest, KvrouteError, Unauthorized
from router.fleet.backends import Backend, Fleet
from router.fleet.discovery import Discovery
from router.fleet.health import HealthChecker
from router.fleet.pools import pool_states
from router.ingress.auth import AdminToken
from router.ingress.web import (
    IngressSite,
    errors_middleware,
    metrics_page,
    no_server_header,
    server_limits,
)
from router.metrics import Metrics

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="kvroute-admin"'}


class AdminHost(Protocol):
    """What the admin API reads and edits of the router process it runs in."""

    config: Config
    fleet: Fleet
    metrics: Metrics
    health: HealthChecker
    reloader: Reloader
    discovery: Discovery

    @property
    def fan_out(self) -> Callable[[bytes], Awaitable[None]] | None:
        """Sends an edit to every worker (this one too); None in a single process."""


class AdminServer:
    def __init__(self, router: AdminHost, cfg: AdminConfig, token: AdminToken) -> None:
        self._router = router
        self._cfg = cfg
        self._token = token
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self._cfg.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(middlewares=[self._authorize, errors_middleware])
        app.add_routes(
            [
                web.get("/admin/backends", self.backends),
                web.post("/admin/backends", self.add),
                web.delete("/admin/backends/{name}", self.remove),
                web.post("/admin/backends/{name}/drain", self.drain),
                web.post("/admin/backends/{name}/undrain", self.undrain),
                web.get("/admin/pools", self.pools),
                web.get("/admin/usage", self.usage),
                web.get("/admin/config", self.config),
                web.post("/admin/reload", self.reload),
            ]
        )
        if self._router.config.metrics.listen == "admin":
            app.add_routes([web.get("/metrics", self.metrics)])
        app.on_response_prepare.append(no_server_header)
        limits = self._router.config.limits
        self._runner = web.AppRunner(app, access_log=None, **server_limits(limits))
        await self._runner.setup()
        site = IngressSite(
            self._runner, limits, host=self._cfg.host, port=self._cfg.port, reuse_address=True
        )
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _authorize(self, request: web.Request, handler) -> web.StreamResponse:
        if request.match_info.handler == self.metrics:  # the scraper holds no admin token
            return await handler(request)
        try:
            self._token.check(request.headers.get("Authorization"))
        except Unauthorized as err:
            return err.to_http(_CHALLENGE)
        try:
            return await handler(request)
        except KvrouteError as err:
            return err.to_http()

    async def metrics(self, request: web.Request) -> web.Response:
        return await metrics_page(self._router.metrics)

    async def backends(self, request: web.Request) -> web.Response:
        fleet = self._router.fleet
        rows = [self._describe(b, "draining" if b.draining else "active") for b in fleet.members]
        rows += [self._describe(b, "retiring") for b in fleet.retired if b.local_inflight]
        return _json({"backends": rows})

    async def add(self, request: web.Request) -> web.Response:
        entry = await _body(request)
        config = self._router.config
        return await self._backends([*_entries(config), entry], status=201)

    async def remove(self, request: web.Request) -> web.Response:
        name = self._known(request).name
        config = self._router.config
        kept = [e for c, e in zip(config.backends, _entries(config), strict=True) if c.key != name]
        return await self._backends(kept)

    async def drain(self, request: web.Request) -> web.Response:
        backend = self._known(request)
        await self._edit({"op": "drain", "name": backend.name, "draining": True})
        return _json(self._describe(backend, "draining"))

    async def undrain(self, request: web.Request) -> web.Response:
        backend = self._known(request)
        await self._edit({"op": "drain", "name": backend.name, "draining": False})
        return _json(self._describe(backend, "active"))

    async def pools(self, request: web.Request) -> web.Response:
        return _json({"pools": [msgspec.to_builtins(s) for s in pool_states(self._router.fleet)]})

    async def usage(self, request: web.Request) -> web.Response:
        cfg = self._router.config.usage
        if not cfg.records:
            raise KvrouteError("Usage records are off (config usage.records).", status=404)
        query = request.query
        since = _instant(query, "since", 0.0)
        until = _instant(query, "until", time.time())
        tenant = query.get("tenant")
        found = await asyncio.to_thread(usage_records.read, cfg.path, since, until, tenant)
        return _json({"since": since, "until": until, "usage": found})

    async def config(self, request: web.Request) -> web.Response:
        return _json(msgspec.to_builtins(self._router.config))

    async def reload(self, request: web.Request) -> web.Response:
        try:
            report = await self._router.reloader.reload()
        except ConfigError as exc:
            raise KvrouteError(f"Reload rejected: {exc}", status=400) from None
        if self._router.fan_out is not None:
            os.kill(os.getppid(), signal.SIGHUP)  # the supervisor reloads every process
        return _json(report)

    async def _backends(self, entries: list[dict], status: int = 200) -> web.Response:
        try:
            report = await self._edit({"op": "backends", "backends": entries})
        except ConfigError as exc:
            raise KvrouteError(str(exc), status=400) from None
        return _json(report, status)

    async def _edit(self, edit: dict) -> dict[str, list[str]]:
        """Apply here (errors reach the caller, nothing changed), then in every worker."""
        report = await apply_edit(self._router, edit)
        if (fan_out := self._router.fan_out) is not None:
            try:
                await fan_out(orjson.dumps(edit))
            except TimeoutError:
                raise KvrouteError(
                    "Applied in worker 0, but the other workers could not be reached; "
                    "reload (POST /admin/reload) to bring them in line.",
                    status=503,
                ) from None
        return report

    def _known(self, request: web.Request) -> Backend:
        name = request.match_info["name"]
        backend = self._router.fleet.find(name)
        if backend is None:
            raise KvrouteError(f"No backend named `{name}`.", status=404)
        return backend

    def _describe(self, b: Backend, state: str) -> dict:
        last = self._router.health.last_pass.get(b.name)
        return _backend_row(b, state, last, asyncio.get_running_loop().time())


def _backend_row(b: Backend, state: str, last_pass: float | None, now: float) -> dict:
    """One backend as GET /admin/backends lists it; `last_pass`, `now`: loop times."""
    return {
        "name": b.name,
        "url": str(b.url),
        "weight": b.weight,
        "models": sorted(b.models) if b.models is not None else None,
        "state": state,
        "usable": b.usable,
        "health": {
            "up": b.healthy,
            "streak": b.check_streak,
            "last_pass_seconds_ago": None if last_pass is None else round(now - last_pass, 3),
        },
        "breaker": b.breaker.state.value,
        "inflight": b.inflight,
    }


async def apply_edit(
    router: AdminHost, edit: dict, everywhere: bool = False
) -> dict[str, list[str]]:
    """Apply a runtime edit (`{"op": "drain", "name", "draining"}`, `{"op": "backends",
    "backends": [entries]}`, or the collector's `{"op": "discovered", "found": {source:
    [entries]}}`) to `router`: the admin API's own, or one broadcast (`everywhere`: the
    collector applies it too). ConfigError if the edited config is invalid."""
    fleet = router.fleet
    if edit["op"] == "drain":
        backend = fleet.find(edit["name"])
        if backend is not None:
            fleet.set_draining(backend, edit["draining"])
        return {}
    if edit["op"] == "discovered":
        router.discovery.adopt(edit["found"])
        return await router.reloader.apply(router.config, everywhere)
    if edit["backends"] == _entries(router.config):  # e.g. a worker's replay (below)
        return {"added": [], "removed": [], "at_restart": []}
    data = msgspec.to_builtins(router.config)
    data["backends"] = edit["backends"]
    return await router.reloader.apply(build(data, "admin"), everywhere)


def discovered_edit(router: AdminHost) -> bytes:
    """The collector's discovered backends, as the edit that gives them to a worker."""
    return orjson.dumps({"op": "discovered", "found": router.discovery.entries()})


def replay_edits(router: AdminHost) -> list[bytes]:
    """The edits that bring a (re)started worker, which read the file, to the router's
    runtime view: the discovered backends, the backend list as edited since, and the
    drained backends. The collector, which applies every edit too, sends them to each
    worker that joins."""
    edits = [{"op": "backends", "backends": _entries(router.config)}]
    edits += [
        {"op": "drain", "name": b.name, "draining": True}
        for b in router.fleet.members
        if b.draining
    ]
    discovered = [discovered_edit(router)] if router.discovery.found else []
    return [*discovered, *(orjson.dumps(edit) for edit in edits)]


def _entries(config: Config) -> list[dict]:
    return [msgspec.to_builtins(c) for c in config.backends]


async def _body(request: web.Request) -> dict:
    try:
        data = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise KvrouteError("The body must be a JSON object.", status=400) from None
    if not isinstance(data, dict):
        raise KvrouteError("The body must be a JSON object.", status=400)
    return data


def _instant(query: Mapping[str, str], name: str, default: float) -> float:
    """A query parameter as epoch seconds: a number, or an ISO 8601 time (UTC if it
    names no zone); BadRequest naming it otherwise."""
    text = query.get(name)
    if text is None:
        return default
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise BadRequest(
            f"`{name}`: expected epoch seconds or an ISO 8601 time, got {text!r}", param=name
        ) from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")
