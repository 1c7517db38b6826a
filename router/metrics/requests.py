"""What each request records: how it ended, how it was routed, how long it took, and
whose it was (admission.py: whether admission made it wait or refused it).

Latencies are measured with `time.perf_counter()`: the event loop's clock, which the
deadlines read, ticks in milliseconds on uvloop, too coarse for a router that adds a
fraction of one. The `model` label names only models a backend lists (`model_label`);
the `endpoint` label is the route's kind (router/request.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram

from policies import SPILL_REASONS, Reason
from router.fleet.backend import Backend
from router.metrics.backends import UPSTREAM_KINDS
from router.metrics.tokens import OTHER
from router.request import Kind

_DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2)
_TTFT_BUCKETS = (
    *(0.0005, 0.001, 0.0025),  # sub-millisecond: the router's own share, a cached prompt
    *(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160),
)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_E2E_BUCKETS = (
    *(0.0005, 0.001, 0.0025, 0.005),  # sub-millisecond: embeddings, errors, cached answers
    *(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
)
#: the tenant label of every tenant the config does not name (not a valid tenant id)
OTHER_TENANT = OTHER
#: the model label of a model no backend lists: clients choose model names
OTHER_MODEL = OTHER_TENANT
#: the model label of a request that names no model (or was refused before it was read)
NO_MODEL = "(none)"
#: the backend label of a request refused before it reached one
NO_BACKEND = "none"

#: the series of kvroute_requests_total that exist at 0 from the start, for each
#: backend and model it lists: what the 5xx-ratio alert and the dashboard's rates read,
#: so that a first increment is seen by rate() as one
_PRIMED_ENDPOINTS = (Kind.CHAT.value, Kind.COMPLETION.value)
_PRIMED_STATUSES = ("200", "502", "503", "504")
#: and for requests refused before any backend (overloaded, no backend available)
_PRIMED_REFUSALS = ("429", "503")


def model_label(model: str | None, known: Container[str]) -> str:
    """The model label of a request for `model`, `known` being the models the backends
    list: each new name a client sends would be one more series for every scrape."""
    if not model:
        return NO_MODEL
    return model if model in known else OTHER_MODEL


class RequestMetrics:
    """The request metrics of `Metrics`."""

    #: the tenants `tenant_request` names, beside the static tokens' ones
    _tenants: frozenset[str]
    tenant_label: Callable[[str | None, Container[str]], str]  # TokenMetrics'

    def _declare_requests(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvroute_requests",
            "Requests finished, by backend, strategy, HTTP status, endpoint and model",
            ["backend", "strategy", "status", "endpoint", "model"],
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
        self.pool_picks = Counter(
            "kvroute_pool_picks",
            "Requests routed to a pool's backend, by pool (a fleet with pools)",
            ["pool"],
            registry=r,
        )
        self.pool_spills = Counter(
            "kvroute_pool_spills",
            "Requests passed from a pool to the next, by pool left and why (saturated: "
            "every backend at the strategy's cap; unavailable: none usable for the model)",
            ["pool", "reason"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvroute_routing_decision_seconds",
            "Time to describe the prompt and pick, with any wait for the workers' pick lock "
            "(microsecond buckets)",
            buckets=_DECISION_BUCKETS,
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
        self._tenant_requests = Counter(
            "kvroute_tenant_requests",
            f"Requests of an authenticated tenant, by tenant ({OTHER_TENANT}: not a known one)",
            ["tenant"],
            registry=r,
        )
        for reason in SPILL_REASONS:
            self.spillovers.labels(reason)
        for tenant in (*self._tenants, OTHER_TENANT):
            self._tenant_requests.labels(tenant)

    def _declare_latencies(self, r: CollectorRegistry) -> None:
        labels = ["backend", "endpoint", "model"]
        self.ttft = Histogram(
            "kvroute_time_to_first_token_seconds",
            "Time from request arrival to the first streamed chunk",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvroute_inter_token_latency_seconds",
            "Time between streamed chunks",
            labels,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvroute_e2e_request_latency_seconds",
            "Time from request arrival to the end of the response",
            labels,
            buckets=_E2E_BUCKETS,
            registry=r,
        )

    def _prime_requests(self, backends: Collection[Backend], strategy: str) -> None:
        """Create at 0 the request counters of `backends` under `strategy` (the ones
        named in this module's _PRIMED_* constants)."""
        known = {m for b in backends for m in b.models or ()}
        for b in backends:
            models = b.models or (OTHER_MODEL,)
            self._prime_outcomes(b.name, strategy, models, _PRIMED_STATUSES)
            self._prime_latencies(b.name, models)
            self.client_disconnects.labels(b.name)
            for kind in UPSTREAM_KINDS:
                self.retries.labels(b.name, kind)
        self._prime_outcomes(NO_BACKEND, strategy, known or (OTHER_MODEL,), _PRIMED_REFUSALS)
        for reason in Reason:
            self.decisions.labels(strategy, reason)

    def _prime_latencies(self, backend: str, models: Iterable[str]) -> None:
        """Create at 0 the latency histograms of `backend` for each of `models`, on the
        primed endpoints: a quantile over rate() has buckets to read from the start."""
        for model in models:
            for endpoint in _PRIMED_ENDPOINTS:
                for histogram in (self.ttft, self.itl, self.e2e):
                    histogram.labels(backend, endpoint, model)

    def _prime_tenants(self, tenants: Iterable[str]) -> None:
        """Create at 0 the request counter of each of `tenants` (the static tokens')."""
        for tenant in tenants:
            self._tenant_requests.labels(tenant)

    def _prime_outcomes(
        self, backend: str, strategy: str, models: Iterable[str], statuses: Iterable[str]
    ) -> None:
        for model in models:
            for endpoint in _PRIMED_ENDPOINTS:
                for status in statuses:
                    self.requests.labels(backend, strategy, status, endpoint, model)

    def tenant_request(self, tenant: str, known: Container[str]) -> None:
        """Count a request of an authenticated tenant: by name if `known` (the static
        tokens' tenants) or the configured `metrics.tenants` has it, else as
        OTHER_TENANT. A signed token or a gateway can carry any tenant, and each new
        name would be one more series for every scrape to carry."""
        self._tenant_requests.labels(self.tenant_label(tenant, known)).inc()
