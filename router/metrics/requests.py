"""What each request records: how it ended, how it was routed, how long it took, and
whose it was."""

from __future__ import annotations

from collections.abc import Callable, Container

from prometheus_client import CollectorRegistry, Counter, Histogram

from router.metrics.tokens import OTHER

_DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
#: the tenant label of every tenant the config does not name (not a valid tenant id)
OTHER_TENANT = OTHER


class RequestMetrics:
    """The request metrics of `Metrics`."""

    #: the tenants `tenant_request` names, beside the static tokens' ones
    _tenants: frozenset[str]
    tenant_label: Callable[[str | None, Container[str]], str]  # TokenMetrics'

    def _declare_requests(self, r: CollectorRegistry) -> None:
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

    def _declare_latencies(self, r: CollectorRegistry) -> None:
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

    def tenant_request(self, tenant: str, known: Container[str]) -> None:
        """Count a request of an authenticated tenant: by name if `known` (the static
        tokens' tenants) or the configured `metrics.tenants` has it, else as
        OTHER_TENANT. A signed token or a gateway can carry any tenant, and each new
        name would be one more series for every scrape to carry."""
        self._tenant_requests.labels(self.tenant_label(tenant, known)).inc()
