"""Backends discovered beside the request path: from DNS names and the Kubernetes API.

Sources (`discovery:` in the YAML, each with `kind`):
- `dns`: every A/AAAA record of a name (a Kubernetes headless Service, a round-robin
  record) is a vLLM server on one port; the name is resolved again every `interval`.
- `kubernetes`: the ready addresses of the EndpointSlices of one Service, listed and then
  watched through the API server with the pod's service-account token; a broken watch
  (or a 410 Gone) lists again.
Whenever a source's address set changes, the current config with the discovered backends
swapped in goes through the reload path (router/control/reload.py: build, validate, swap), so new
backends get a health check first and vanished ones drain like removed ones. The
discovered backends are merged into every applied config, a SIGHUP reload of the file
included. A failing source keeps its last good list, logs, and counts
`kvroute_discovery_errors_total{source}`. With several workers only the collector runs
the sources (one resolver, one watch on the API server) and hands each change to the
workers as an edit (the collector's `rediscover`), so every worker routes over the same fleet and
takes the collector's health checks of the new backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import msgspec
import orjson
from yarl import URL

from router import log
from router.config import (
    BackendConfig,
    Config,
    ConfigError,
    DnsDiscoveryConfig,
    KubernetesDiscoveryConfig,
    KvEventsConfig,
)

Resolver = Callable[[str, int], Awaitable[list[str]]]
_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_RETRY_S = 1.0
#: a source's failures are warned of at most once this often, recoveries between them
#: or not (the metric kvroute_discovery_errors_total counts every failure)
_REPEAT_WARNING_S = 300.0


class _Counters(Protocol):
    discovered_backends: Any  # prometheus Gauge, labelled by source
    discovery_errors: Any  # prometheus Counter, labelled by source


class DiscoveryHost(Protocol):
    """What discovery needs of the router it feeds: the sources, where to count, and a
    way to apply the config with the newly discovered backends (`rediscover`)."""

    @property
    def config(self) -> Config: ...

    @property
    def metrics(self) -> _Counters: ...

    async def rediscover(self) -> None:
        """Apply the current config again (merged with `found`); ConfigError if refused."""


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses the system resolver gives for `host` (A and AAAA), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def backend_configs(
    source: DnsDiscoveryConfig | KubernetesDiscoveryConfig, addresses: Iterable[str]
) -> list[BackendConfig]:
    return [_backend(source, address) for address in sorted(set(addresses))]


def _backend(source: DnsDiscoveryConfig | KubernetesDiscoveryConfig, address: str) -> BackendConfig:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    kv = None
    if source.kv_events_port is not None:
        replay = f"tcp://{host}:{source.kv_replay_port}" if source.kv_replay_port else None
        kv = KvEventsConfig(f"tcp://{host}:{source.kv_events_port}", replay, source.kv_topic)
    return BackendConfig(
        url=f"http://{host}:{source.port}",
        weight=source.weight,
        models=source.models,
        kv_events=kv,
        pool=source.pool,
    )


def ready_addresses(slices: Iterable[dict[str, Any]]) -> set[str]:
    """Addresses of the ready endpoints of EndpointSlice objects (ready unset = ready)."""
    out: set[str] = set()
    for item in slices:
        for endpoint in item.get("endpoints") or ():
            if (endpoint.get("conditions") or {}).get("ready", True) is not False:
                out.update(endpoint.get("addresses") or ())
    return out


class Discovery:
    def __init__(self, host: DiscoveryHost, resolver: Resolver = system_resolver) -> None:
        self._host = host
        self._resolver = resolver
        #: the last good backends of each source, by source label
        self.found: dict[str, list[BackendConfig]] = {}
        self._merged: set[str] = set()
        self._changed = asyncio.Event()
        #: per failing source: failures in a row, and whether one of them was warned of
        self._outages: dict[str, tuple[int, bool]] = {}
        #: per source, its failure warnings: one per _REPEAT_WARNING_S, the next saying
        #: how many were left out (a source that flaps must not warn at every failure)
        self._warnings: dict[str, log.Throttled] = {}

    def merge(self, config: Config) -> Config:
        """`config` with the discovered backends in place of the previously merged ones."""
        static = [b for b in config.backends if b.key not in self._merged]
        discovered = [b for backends in self.found.values() for b in backends]
        merged = msgspec.structs.replace(config, backends=[*static, *discovered])
        try:
            merged.__post_init__()
        except ValueError as exc:
            raise ConfigError(f"discovery: {exc}") from exc
        self._merged = {b.key for b in discovered}
        return merged

    def entries(self) -> dict[str, list[dict]]:
        """The last good backends of each source, as config entries."""
        return {label: msgspec.to_builtins(found) for label, found in self.found.items()}

    def adopt(self, entries: dict[str, list[dict]]) -> None:
        """Take another process's `entries` (a worker, from the collector, which runs the
        sources for the router); the next applied config merges them."""
        self.found = msgspec.convert(entries, dict[str, list[BackendConfig]])

    async def run(self) -> None:
        sources = self._host.config.discovery
        if not sources:
            return
        for source in sources:  # each source's error counter exists at 0
            self._host.metrics.discovery_errors.labels(source.label)
        watchers = [asyncio.create_task(self._watch(s), name=f"kvroute-{s.label}") for s in sources]
        try:
            while True:
                await self._changed.wait()
                self._changed.clear()
                # a rejected config is logged by the reloader; the old fleet keeps serving
                with contextlib.suppress(ConfigError):
                    await self._host.rediscover()
        finally:
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    async def _watch(self, source: DnsDiscoveryConfig | KubernetesDiscoveryConfig) -> None:
        follow = self._dns if isinstance(source, DnsDiscoveryConfig) else self._kubernetes
        while True:
            try:
                await follow(source)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: keep the last list, count, retry
                self._failed(source.label, exc)
                await asyncio.sleep(_RETRY_S)

    async def _dns(self, source: DnsDiscoveryConfig) -> None:
        while True:
            try:
                addresses = await self._resolver(source.name, source.port)
            except OSError as exc:
                self._failed(source.label, exc)
            else:
                self._update(source, addresses)
            await asyncio.sleep(source.interval)

    async def _kubernetes(self, source: KubernetesDiscoveryConfig) -> None:
        api = _KubeApi(source)
        async with aiohttp.ClientSession(headers=api.headers()) as http:
            slices, version = await api.list(http)
            self._update(source, ready_addresses(slices.values()))
            async for kind, obj in api.watch(http, version):
                name = (obj.get("metadata") or {}).get("name", "")
                if kind == "DELETED":
                    slices.pop(name, None)
                elif kind in ("ADDED", "MODIFIED"):
                    slices[name] = obj
                else:
                    continue  # BOOKMARK
                self._update(source, ready_addresses(slices.values()))

    def _update(self, source, addresses: Iterable[str]) -> None:
        backends = backend_configs(source, addresses)
        self._host.metrics.discovered_backends.labels(source.label).set(len(backends))
        outage = self._outages.pop(source.label, None)
        if outage is not None and outage[1]:  # the outage was warned of
            log.backends.info(
                "discovery from %s answers again, after %d failures", source.label, outage[0]
            )
        before = self.found.get(source.label)
        if backends != before:
            self.found[source.label] = backends
            self._changed.set()
            _log_change(source.label, before or [], backends)

    def _failed(self, label: str, exc: BaseException) -> None:
        """Count a failure; warn at most once per _REPEAT_WARNING_S for the source (one
        retried each second, or one that flaps, would otherwise flood the log)."""
        self._host.metrics.discovery_errors.labels(label).inc()
        failures, warned = self._outages.get(label, (0, False))
        warnings = self._warnings.get(label)
        if warnings is None:
            warnings = self._warnings[label] = log.Throttled(log.backends, 1, _REPEAT_WARNING_S)
        said = warnings.warning(
            "discovery from %s failed (%d in a row), keeping the last list: %s",
            label, failures + 1, exc,
        )  # fmt: skip
        self._outages[label] = (failures + 1, warned or said)


def _log_change(label: str, before: list[BackendConfig], after: list[BackendConfig]) -> None:
    """Which addresses a source's answer added and removed (on a change only)."""
    old, new = {b.url for b in before}, {b.url for b in after}
    added, removed = sorted(new - old), sorted(old - new)
    log.backends.info(
        "discovery from %s: %d backends (added: %s; removed: %s)",
        label,
        len(after),
        ", ".join(added) or "none",
        ", ".join(removed) or "none",
    )


class _KubeApi:
    """The two EndpointSlice calls discovery makes: list, then watch from its version."""

    def __init__(self, source: KubernetesDiscoveryConfig) -> None:
        self._source = source
        api = source.api_server or _in_cluster_api()
        namespace = source.namespace or Path(_NAMESPACE_FILE).read_text().strip()
        path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self._url = (
            URL(api)
            .with_path(path)
            .with_query(labelSelector=f"kubernetes.io/service-name={source.service}")
        )
        self._ssl: ssl.SSLContext | bool = True
        if self._url.scheme == "https" and source.ca_file and Path(source.ca_file).exists():
            self._ssl = ssl.create_default_context(cafile=source.ca_file)

    def headers(self) -> dict[str, str]:
        token = Path(self._source.token_file).read_text().strip()  # re-read: tokens rotate
        return {"Authorization": f"Bearer {token}"}

    async def list(self, http: aiohttp.ClientSession) -> tuple[dict[str, dict], str]:
        async with http.get(self._url, ssl=self._ssl) as resp:
            resp.raise_for_status()
            body = orjson.loads(await resp.read())
        items = {(i.get("metadata") or {}).get("name", ""): i for i in body.get("items") or ()}
        return items, (body.get("metadata") or {}).get("resourceVersion", "")

    async def watch(self, http: aiohttp.ClientSession, version: str):
        """Yield (type, object) watch events until the stream ends or says 410 Gone."""
        url = self._url.update_query(watch="1", resourceVersion=version, allowWatchBookmarks="true")
        async with http.get(url, ssl=self._ssl, timeout=aiohttp.ClientTimeout(total=None)) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if not line.strip():
                    continue
                event = orjson.loads(line)
                if event.get("type") == "ERROR":  # e.g. 410 Gone: the caller lists again
                    raise ConnectionError(f"watch error: {event.get('object')}")
                yield event.get("type"), event.get("object") or {}
        raise ConnectionError("watch stream ended")


def _in_cluster_api() -> str:
    host, port = (
        os.environ.get("KUBERNETES_SERVICE_HOST"),
        os.environ.get("KUBERNETES_SERVICE_PORT"),
    )
    if not host or not port:
        raise ConfigError("kubernetes discovery: set api_server, or run inside a cluster")
    return f"https://{host}:{port}"
