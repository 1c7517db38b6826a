"""The backends' side: failures talking to them, the breakers' refused ejections, panic
routing, discovery, and the per-backend gauges read from backend state at scrape time
(so the request path pays nothing for them). A backend's counters exist at 0 from the
scrape after it joined (`_prime_backends`), each of its state changes too."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.errors import (
    UpstreamConnectError,
    UpstreamCredentialsRefused,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamTimeout,
)
from router.fleet.backend import Backend
from router.fleet.breaker import BreakerState
from router.fleet.pools import PoolState

#: the `kind` of kvroute_upstream_errors_total (and the `reason` of a retry after one)
UPSTREAM_KINDS = tuple(
    e.kind
    for e in (
        UpstreamError,
        UpstreamConnectError,
        UpstreamDisconnected,
        UpstreamTimeout,
        UpstreamCredentialsRefused,
    )
)
#: each backend's learned speed (router/fleet/speeds.py), in `Speed`'s order
_SPEEDS = (
    ("kvroute_backend_prefill_tokens_per_second", "Learned prefill rate (KV_AWARE)"),
    ("kvroute_backend_decode_step_seconds", "Learned decode step alone (KV_AWARE)"),
    (
        "kvroute_backend_decode_step_seconds_per_request",
        "Learned decode step growth per running request (KV_AWARE)",
    ),
)
#: the states kvroute_backend_state_changes_total counts entering (fleet/usability.py)
_STATES = ("up", "down", "draining", "undrained", *BreakerState)


class BackendMetrics:
    """The backend and fleet metrics of `Metrics`."""

    def _declare_backends(self, r: CollectorRegistry) -> None:
        self.upstream_errors = Counter(
            "kvroute_upstream_errors",
            "Failures talking to a backend, by kind",
            ["backend", "kind"],
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

    def _prime_backends(self, backends: Iterable[Backend]) -> None:
        """Create each backend's counters at 0."""
        for b in backends:
            self.ejections_refused.labels(b.name)
            for kind in UPSTREAM_KINDS:
                self.upstream_errors.labels(b.name, kind)


class BackendCollector:
    """Each backend's in-flight count, usability, health, breaker state and state
    changes, read when /metrics is scraped: `snapshot` reads them (on the event loop,
    whose state they are), and the copy's `collect` builds the page's families (in any
    thread)."""

    def __init__(self, members: Callable[[], Iterable[Backend]]) -> None:
        self._members = members

    def snapshot(self) -> _BackendRows:
        rows = []
        for b in self._members():
            state = (b.own_inflight, b.usable, b.healthy, b.breaker.state)
            rows.append((b.name, *state, dict(b.transitions), b.learned_speed))
        return _BackendRows(rows)


class _BackendRows:
    """What `BackendCollector.snapshot` read, a row per backend."""

    def __init__(self, rows: list[tuple]) -> None:
        self._rows = rows

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
        speeds = [GaugeMetricFamily(name, doc, labels=["backend"]) for name, doc in _SPEEDS]
        for name, own_inflight, usable, healthy, breaker, transitions, learned in self._rows:
            inflight.add_metric([name], own_inflight)
            up.add_metric([name], 1.0 if usable else 0.0)
            checks.add_metric([name], 1.0 if healthy else 0.0)
            for state in BreakerState:
                circuit.add_metric([name, state], 1.0 if breaker is state else 0.0)
            for to, count in {**dict.fromkeys(_STATES, 0), **transitions}.items():
                changes.add_metric([name, to], count)
            if learned is not None:
                for family, value in zip(speeds, learned, strict=True):
                    family.add_metric([name], value)
        return [inflight, up, checks, circuit, changes, *speeds]


class PoolCollector:
    """Each pool's backends, load, saturation and the backends an autoscaler could
    remove, fallbacks first (router/fleet/pools.py), read when /metrics is scraped."""

    _GAUGES = (
        ("backends", "kvroute_pool_backends", "Backends configured or discovered in the pool"),
        ("usable", "kvroute_pool_usable_backends", "The pool's backends usable for routing"),
        ("inflight", "kvroute_pool_inflight_requests", "Requests in flight to the pool"),
        (
            "saturation",
            "kvroute_pool_saturation",
            "In flight over the usable backends' capacity (concurrency_threshold each)",
        ),
        (
            "wanted",
            "kvroute_pool_wanted_backends",
            "Backends of the pool that carry what is in flight, preferred pools first",
        ),
        (
            "removable",
            "kvroute_pool_removable_backends",
            "Backends of the pool that could be removed without losing capacity",
        ),
    )

    def __init__(self, states: Callable[[], list[PoolState]]) -> None:
        self._states = states

    def snapshot(self) -> PoolCollector:
        """The pools' states as now (on the event loop), to collect in any thread."""
        states = self._states()
        return PoolCollector(lambda: states)

    def collect(self) -> Iterable[Metric]:
        states = self._states()  # none for a flat fleet: each family without a series
        families = []
        for field, name, doc in self._GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["pool"])
            for state in states:
                value = getattr(state, field)
                if value is not None:
                    family.add_metric([state.name], value)
            families.append(family)
        return families
