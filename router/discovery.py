"""Backends from DNS, beside the request path: the addresses of a name are the fleet.

Each `discovery:` source names a DNS name (a Kubernetes headless Service, a round-robin
record) whose A/AAAA records are vLLM servers on one port. Every `interval` seconds the
name is resolved again; when the set of addresses changes, the current config with the
discovered backends swapped in goes through the reload path (router/reload.py: build,
validate, swap), so new backends get a health check first and vanished ones drain like
removed ones. The discovered backends are merged into every applied config, a SIGHUP
reload of the file included. A failed resolution keeps the last good list, logs, and
counts `kvroute_discovery_errors_total{source}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec

from router import log
from router.config import BackendConfig, Config, ConfigError, DnsDiscoveryConfig, KvEventsConfig

if TYPE_CHECKING:
    from router.app import Router

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses the system resolver gives for `host` (A and AAAA), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def backend_configs(source: DnsDiscoveryConfig, addresses: list[str]) -> list[BackendConfig]:
    return [_backend(source, address) for address in addresses]


def _backend(source: DnsDiscoveryConfig, address: str) -> BackendConfig:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    kv = None
    if source.kv_events_port is not None:
        replay = f"tcp://{host}:{source.kv_replay_port}" if source.kv_replay_port else None
        kv = KvEventsConfig(f"tcp://{host}:{source.kv_events_port}", replay, source.kv_topic)
    return BackendConfig(
        url=f"http://{host}:{source.port}", weight=source.weight, models=source.models, kv_events=kv
    )


class Discovery:
    def __init__(self, router: Router, resolver: Resolver = system_resolver) -> None:
        self._router = router
        self._resolver = resolver
        #: the last good addresses' backends of each source
        self.found: dict[str, list[BackendConfig]] = {}
        self._merged: set[str] = set()

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

    async def run(self) -> None:
        sources = self._router.config.discovery
        if not sources:
            return
        while True:
            changed = await self.refresh(sources)
            if changed:  # a rejected config is logged by the reloader; the old one serves
                with contextlib.suppress(ConfigError):
                    await self._router.reloader.apply(self._router.config)
            await asyncio.sleep(min(s.interval for s in sources))

    async def refresh(self, sources: list[DnsDiscoveryConfig]) -> bool:
        """Resolve every source once; True when any address set changed."""
        results = await asyncio.gather(
            *(self._resolver(s.name, s.port) for s in sources), return_exceptions=True
        )
        changed = False
        metrics = self._router.metrics
        for source, result in zip(sources, results, strict=True):
            if isinstance(result, BaseException):
                metrics.discovery_errors.labels(source.name).inc()
                log.backends.warning(
                    "resolving %s failed, keeping the last list: %s", source.name, result
                )
                continue
            backends = backend_configs(source, result)
            if backends != self.found.get(source.name):
                self.found[source.name] = backends
                changed = True
            metrics.discovered_backends.labels(source.name).set(len(backends))
        return changed
