"""Every Prometheus metric of the router, defined once per router instance.

Each router gets its own CollectorRegistry so several can live in one process (tests,
the benchmark harness). Per-backend gauges are read from backend state at scrape time
by a collector, so the request path pays nothing for them. Label values come from the
config and the router's own vocabularies, never from what a client sends: a tenant the
config does not know is `(other)` (`tenant_request`).

With several workers (router/control/supervisor.py) every process writes its counters and
histograms to prometheus-client's multiprocess files and `render` sums them over all
processes, dead ones included (counters never go back); gauges are "livemax" (a dead
process's gauge disappears). The per-backend gauges come from the answering worker;
their in-flight counts are router-wide (the shared load table). Process metrics
(CPU, memory, fds) are per process and are left out there. Otherwise both modes export
the same series: no `_created` ones (multiprocess mode has none), and no `_sum` for a
histogram whose buckets go below zero (a single process's prometheus-client has none).
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Container, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from router.fleet.backends import Backend
from router.fleet.breaker import BreakerState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_ERROR_BUCKETS = (-8192, -2048, -512, -128, -32, -1, 0, 1, 32, 128, 512, 2048, 8192)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
LAG_INTERVAL = 0.25  # seconds between two looks at the event loop's lag
#: the tenant label of every tenant the config does not name (not a valid tenant id)
OTHER_TENANT = "(other)"

# process-wide: multiprocess mode cannot export `_created` series, so neither mode does
disable_created_metrics()


class _BackendCollector:
    def __init__(self, members: Callable[[], Iterable[Backend]]) -> None:
        self._members = members

    def collect(self) -> Iterable[Metric]:
        inflight = GaugeMetricFamily(
            "kvroute_backend_inflight_requests",
            "Requests the router has in flight to each backend",
            labels=["backend"],
        )
        up = GaugeMetricFamily(
            "kvroute_backend_up", "1 if the backend is usable for routing", labels=["backend"]
        )
        checks = GaugeMetricFamily(
            "kvroute_backend_health_check_up",
            "1 if the backend passes its active health checks",
            labels=["backend"],
        )
        circuit = GaugeMetricFamily(
            "kvroute_backend_circuit_state",
            "1 for the state the backend's circuit breaker is in",
            labels=["backend", "state"],
        )
        changes = CounterMetricFamily(
            "kvroute_backend_state_changes",
            "Health, breaker and drain state changes, by the state entered",
            labels=["backend", "to"],
        )
        for b in self._members():
            inflight.add_metric([b.name], b.inflight)
            up.add_metric([b.name], 1.0 if b.usable else 0.0)
            checks.add_metric([b.name], 1.0 if b.healthy else 0.0)
            for state in BreakerState:
                circuit.add_metric([b.name, state], 1.0 if b.breaker.state is state else 0.0)
            for to, count in b.transitions.items():
                changes.add_metric([b.name, to], count)
        return [inflight, up, checks, circuit, changes]


class _EveryProcess:
    """Every process's metric files, summed, as one process would export them."""

    def __init__(self) -> None:
        self._files = MultiProcessCollector(None)

    def collect(self) -> Iterable[Metric]:
        for family in self._files.collect():
            if family.type == "histogram" and _below_zero(family):
                # such a sum can fall, so it is no counter: a single process leaves it out
                total = family.name + "_sum"
                family.samples = [s for s in family.samples if s.name != total]
            yield family


def _below_zero(histogram: Metric) -> bool:
    return any(float(s.labels.get("le", 0)) < 0 for s in histogram.samples)


class Metrics:
    def __init__(
        self,
        members: Callable[[], Iterable[Backend]],
        multiprocess: bool = False,
        tenants: Iterable[str] = (),
    ) -> None:
        """`tenants`: the ones `tenant_request` names, beside the static tokens' ones."""
        self._tenants = frozenset(tenants)
        r = self.registry = CollectorRegistry()
        #: what /metrics shows: this registry, or with several workers every process's
        self._exported = CollectorRegistry() if multiprocess else r
        if multiprocess:
            self._exported.register(_EveryProcess())
        else:
            ProcessCollector(registry=r)
        PlatformCollector(registry=self._exported)
        self._exported.register(_BackendCollector(members))
        self.requests = Counter(
            "kvroute_requests",
            "Requests finished, by backend, strategy and HTTP status",
            ["backend", "strategy", "status"],
            registry=r,
        )
        self.decisions = Counter(
            "kvroute_policy_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.spillovers = Counter(
            "kvroute_spillovers",
            "Requests not sent to their pinned backend, by reason",
            ["reason"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvroute_routing_decision_seconds",
            "Time to describe the prompt and pick, with any wait for the workers' pick lock "
            "(microsecond buckets)",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvroute_time_to_first_token_seconds",
            "Time from request arrival to the first streamed chunk",
            ["backend"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvroute_inter_token_latency_seconds",
            "Time between streamed chunks",
            ["backend"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvroute_e2e_request_latency_seconds",
            "Time from request arrival to the end of the response",
            ["backend"],
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvroute_upstream_errors",
            "Failures talking to a backend, by kind",
            ["backend", "kind"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "kvroute_client_disconnects",
            "Requests whose client went away before the response ended",
            ["backend"],
            registry=r,
        )
        self.retries = Counter(
            "kvroute_retries",
            "Attempts retried on another backend, by the failed backend and why",
            ["backend", "reason"],
            registry=r,
        )
        self.ejections_refused = Counter(
            "kvroute_breaker_ejections_refused",
            "Breaker openings refused by max_ejection_percent, by backend",
            ["backend"],
            registry=r,
        )
        self.panic_routing = Counter(
            "kvroute_panic_routing",
            "Routing decisions in panic: too few backends usable, so those only their "
            "breaker kept out were candidates too",
            registry=r,
        )
        self._tenant_requests = Counter(
            "kvroute_tenant_requests",
            f"Requests of an authenticated tenant, by tenant ({OTHER_TENANT}: not a known one)",
            ["tenant"],
            registry=r,
        )

        self.prediction_error = Histogram(
            "kvroute_kv_prediction_error_tokens",
            "Predicted minus backend-reported cached prompt tokens, per request",
            buckets=_ERROR_BUCKETS,
            registry=r,
        )
        self.cached_tokens = Counter(
            "kvroute_cached_tokens",
            "Cached prompt tokens, as predicted by the router and as reported by backends",
            ["source"],
            registry=r,
        )

        self.telemetry_fallbacks = Counter(
            "kvroute_telemetry_fallbacks",
            "Telemetry downgrades by backend and reason (scrape_failed, stale_metrics, "
            "event_reset)",
            ["backend", "reason"],
            registry=r,
        )
        self._index_mode = Gauge(
            "kvroute_backend_index_mode",
            "1 for the prefix-index source each backend is in: events or approximate",
            ["backend", "mode"],
            registry=r,
            multiprocess_mode="livemax",
        )

        self.discovery_errors = Counter(
            "kvroute_discovery_errors",
            "Failed DNS resolutions of a discovery source (the last good list is kept)",
            ["source"],
            registry=r,
        )
        self.discovered_backends = Gauge(
            "kvroute_discovered_backends",
            "Backends a discovery source resolved to, last good resolution",
            ["source"],
            registry=r,
            multiprocess_mode="livemax",
        )

        self.loop_lag = Histogram(
            "kvroute_event_loop_lag_seconds",
            "How late a serving process's event loop ran a timer: how long a new request "
            "may wait for its turn (README, New requests while streams flow)",
            buckets=_LAG_BUCKETS,
            registry=r,
        )

    async def watch_loop_lag(self) -> None:
        """Every LAG_INTERVAL, how late the loop woke this task (a timer): four wake-ups
        a second, nothing on the request path."""
        loop = asyncio.get_running_loop()
        observe = self.loop_lag.observe
        while True:
            due = loop.time() + LAG_INTERVAL
            await asyncio.sleep(LAG_INTERVAL)
            observe(max(0.0, loop.time() - due))

    def tenant_request(self, tenant: str, known: Container[str]) -> None:
        """Count a request of an authenticated tenant: by name if `known` (the static
        tokens' tenants) or the configured `metrics.tenants` has it, else as
        OTHER_TENANT. A signed token or a gateway can carry any tenant, and each new
        name would be one more series for every scrape to carry."""
        named = tenant in self._tenants or tenant in known
        self._tenant_requests.labels(tenant if named else OTHER_TENANT).inc()

    def index_mode(self, backend: str, events: bool) -> None:
        self._index_mode.labels(backend, "events").set(1 if events else 0)
        self._index_mode.labels(backend, "approximate").set(0 if events else 1)

    def render(self) -> bytes:
        return generate_latest(self._exported)


class Tally:
    """One stream's observations of a histogram child, added to it in one go by `flush`.

    `Histogram.observe` takes a lock and, with several workers, writes the mmap'd
    multiprocess file twice per call: once per SSE event that was ~6% of a streaming
    worker's CPU. Here an observation is a bisect and two adds. Reads prometheus-client's
    child internals (`_upper_bounds`, `_buckets`, `_sum`), stable since 0.4.
    """

    __slots__ = ("_bounds", "_child", "_counts", "_total")

    def __init__(self, child: Histogram) -> None:
        self._child = child
        self._bounds = child._upper_bounds
        self._counts = [0] * len(self._bounds)
        self._total = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1  # the first bound >= value
        self._total += value

    def flush(self) -> None:
        """Add what was counted since the last flush to the histogram."""
        buckets = self._child._buckets
        for i, n in enumerate(self._counts):
            if n:
                buckets[i].inc(n)
                self._counts[i] = 0
        self._child._sum.inc(self._total)
        self._total = 0.0
