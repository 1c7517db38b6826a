"""`Metrics`: one router's metrics, with a CollectorRegistry of its own so that several
routers can live in one process (tests, the benchmark harness).

Single-process and multiprocess routers export the same series (process.py says how
the second sums its workers): no `_created` ones (multiprocess mode has none), and no
`_sum` for a histogram whose buckets go below zero (a single process's
prometheus-client has none).

Counters and histograms exist at 0 before anything is counted, so that rate() sees a
first increment: unlabelled ones by themselves, labelled ones for the values known at the
start (reasons, sources, `metrics.tenants`) and, from the first scrape after a backend
joined (config, reload, discovery, admin API), the strategy changed or a static token
named a new tenant, each backend's (its latency histograms too) and each such tenant's.
Each scrape compares the members, their models and the static tokens' tenants with what
was primed last: O(fleet + tenants), off the request path.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Collection, Iterable

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.registry import Collector

from router.fleet.backend import Backend
from router.fleet.pools import PoolState
from router.metrics.admission import AdmissionMetrics
from router.metrics.backends import BackendCollector, BackendMetrics, PoolCollector
from router.metrics.jobs import JobMetrics
from router.metrics.merged import MergedFiles
from router.metrics.process import ProcessMetrics, exported
from router.metrics.requests import RequestMetrics
from router.metrics.telemetry import TelemetryMetrics
from router.metrics.tokens import TokenMetrics
from router.metrics.values import use as compact_values

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: the backends and static tenants a scrape primes
_Unprimed = tuple[tuple[Backend, ...], frozenset[str]]

# process-wide: multiprocess mode cannot export `_created` series, so neither mode does
disable_created_metrics()


class Metrics(
    RequestMetrics,
    AdmissionMetrics,
    TokenMetrics,
    BackendMetrics,
    TelemetryMetrics,
    JobMetrics,
    ProcessMetrics,
):
    """Every metric of one router, declared by group (the bases' modules)."""

    def __init__(
        self,
        members: Callable[[], Iterable[Backend]],
        multiprocess: bool = False,
        tenants: Iterable[str] = (),
        pools: Callable[[], list[PoolState]] | None = None,
        static_tenants: Callable[[], Collection[str]] = tuple,
    ) -> None:
        """`tenants`: the ones `tenant_request` names, beside the static tokens' ones
        (`static_tenants`, read at each scrape: a reload changes them); `pools`: the
        pools' states, for a fleet that has pools."""
        self._tenants = frozenset(tenants)
        self._static_tenants = static_tenants
        self._members = members
        #: the routing strategy's name, as the metrics label it (dispatch sets it, and
        #: the collector, which primes the workers' series)
        self.strategy = ""
        self._primed: tuple[str, tuple, frozenset[str]] = ("", (), frozenset())
        if multiprocess:
            compact_values()
        r = self.registry = CollectorRegistry()
        #: what /metrics shows beside this registry (one process) or every process's
        #: files (several): the process's and the platform's numbers, the release
        self._exported = exported(multiprocess)
        self._files = MergedFiles(os.environ["PROMETHEUS_MULTIPROC_DIR"]) if multiprocess else None
        #: a worker's way to the counted series merged elsewhere (the collector's: one
        #: process keeps a merged page's state and every backend's series at 0, not each
        #: worker that answers a scrape); None: merged, or this registry's, here
        self.counted_elsewhere: Callable[[], Awaitable[bytes]] | None = None
        #: and what reads the loop's state: read on the loop, made a page anywhere
        self._of_loop: list[BackendCollector | PoolCollector] = [BackendCollector(members)]
        if pools is not None:
            self._of_loop.append(PoolCollector(pools))
        self._declare_requests(r)
        self._declare_admission(r)
        self._declare_latencies(r)
        self._declare_tokens(r)
        self._declare_backends(r)
        self._declare_telemetry(r)
        self._declare_jobs(r)
        self._declare_process(r)

    def render(self) -> bytes:
        return self._page(self._unprimed(), [c.snapshot() for c in self._of_loop])

    async def render_off_loop(self) -> bytes:
        """`render` with all but the reading of the loop's state in a thread: at a
        thousand backends the page has ~160,000 series, and the loop goes on serving
        meanwhile (between the interpreter's switches). The loop reads which backends
        and tenants there are and the backends' states; the thread primes the new
        series, merges the processes' files and formats the page. With the counted
        series merged elsewhere, they are fetched and only the rest is formatted here."""
        read = [c.snapshot() for c in self._of_loop]
        if self.counted_elsewhere is None:
            return await asyncio.to_thread(self._page, self._unprimed(), read)
        counted = await self.counted_elsewhere()
        return counted + await asyncio.to_thread(self._states, read)

    async def counted_off_loop(self) -> bytes:
        """The counted series (every process's files merged, or this registry's), new
        series primed first: in a thread, as `render_off_loop`."""
        return await asyncio.to_thread(self._counted, self._unprimed())

    def _page(self, unprimed: _Unprimed | None, read: list[Collector]) -> bytes:
        """The page: the counted series, then `read` and the process's numbers."""
        return self._counted(unprimed) + self._states(read)

    def _counted(self, unprimed: _Unprimed | None) -> bytes:
        """This process's counted series, or every process's files merged (`unprimed`
        primed first)."""
        if unprimed is not None:
            self._prime(*unprimed)
        if self._files is not None:
            return self._files.text().encode()
        return generate_latest(self.registry)

    def _states(self, read: list[Collector]) -> bytes:
        """`read` (the loop's state, snapshotted) and the process's numbers."""
        states = CollectorRegistry(auto_describe=False)
        for collector in read:
            states.register(collector)
        return generate_latest(states) + generate_latest(self._exported)

    def _unprimed(self) -> _Unprimed | None:
        """The backends and static tenants to prime, when they (or the strategy) changed
        since the last priming."""
        backends = tuple(self._members())
        static = frozenset(self._static_tenants())
        primed = (self.strategy, tuple((b.name, b.models) for b in backends), static)
        if primed == self._primed:
            return None
        self._primed = primed
        return backends, static

    def _prime(self, backends: tuple[Backend, ...], static: frozenset[str]) -> None:
        """Create at 0 the series of `backends`, the strategy and the tenants."""
        if self.strategy:  # else not known yet (no request path built)
            self._prime_requests(backends, self.strategy)
            self._prime_tenants(static)
            self._prime_flow_tenants(static)
            served = {(m, b.pool) for b in backends for m in b.models or ()}
            self._prime_tokens(served, self._tenants | static)
        self._prime_backends(backends)
        self._prime_telemetry(backends)
