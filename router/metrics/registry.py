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
from collections.abc import Callable, Collection, Iterable

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest

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
        #: the routing strategy's name, as the metrics label it (dispatch sets it)
        self.strategy = ""
        self._primed: tuple[str, tuple, frozenset[str]] = ("", (), frozenset())
        if multiprocess:
            compact_values()
        r = self.registry = CollectorRegistry()
        #: what /metrics shows beside this registry (one process) or every process's
        #: files (several): collectors that read the loop's state or the process's
        self._exported = exported(multiprocess)
        self._files = MergedFiles(os.environ["PROMETHEUS_MULTIPROC_DIR"]) if multiprocess else None
        self._exported.register(BackendCollector(members))
        if pools is not None:
            self._exported.register(PoolCollector(pools))
        self._declare_requests(r)
        self._declare_admission(r)
        self._declare_latencies(r)
        self._declare_tokens(r)
        self._declare_backends(r)
        self._declare_telemetry(r)
        self._declare_jobs(r)
        self._declare_process(r)

    def render(self) -> bytes:
        unprimed = self._unprimed()
        return self._counted(unprimed).encode() + generate_latest(self._exported)

    async def render_off_loop(self) -> bytes:
        """`render` with the priming of new series and the page of the counted ones in a
        thread: at a thousand backends that is ~140,000 series, and the loop goes on
        serving meanwhile (between the interpreter's switches). What reads the loop's
        state (which backends and tenants there are, the backends' gauges) stays on
        the loop."""
        unprimed = self._unprimed()
        counted = await asyncio.to_thread(self._counted, unprimed)
        return counted.encode() + generate_latest(self._exported)

    def _counted(self, unprimed: tuple[tuple[Backend, ...], frozenset[str]] | None) -> str:
        """The counters', gauges' and histograms' page: this process's, or every
        process's files merged; `unprimed` primed first."""
        if unprimed is not None:
            self._prime(*unprimed)
        if self._files is not None:
            return self._files.text()
        return generate_latest(self.registry).decode()

    def _unprimed(self) -> tuple[tuple[Backend, ...], frozenset[str]] | None:
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
        if self.strategy:  # else no request path in this process (the collector)
            self._prime_requests(backends, self.strategy)
            self._prime_tenants(static)
            self._prime_flow_tenants(static)
            served = {(m, b.pool) for b in backends for m in b.models or ()}
            self._prime_tokens(served, self._tenants | static)
        self._prime_backends(backends)
        self._prime_telemetry(backends)
