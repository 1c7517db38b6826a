"""What admission records: its queue's depth (total, by class, by tenant), each waiter's
wait, and each refusal by its reason. Set only when the queue changes: a request
admitted at once touches none of these."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.config import PRIORITIES
from router.metrics.requests import OTHER_TENANT
from router.metrics.tokens import NO_TENANT

#: admission queue waits, seconds
_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Refusal(StrEnum):
    """Why admission refused a request: the `reason` of its rejections, and its answer's
    `x-kvroute-drop-reason`."""

    SATURATED = "saturated"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    TENANT_CAP = "tenant_cap"
    SHED = "shed"


class AdmissionMetrics:
    """The admission metrics of `Metrics`."""

    #: the tenants `tenant_request` names, beside the static tokens' ones
    _tenants: frozenset[str]

    def _declare_admission(self, r: CollectorRegistry) -> None:
        self.admission_queue = Gauge(
            "kvroute_admission_queue_depth",
            "Requests waiting in admission's queue for a slot now (summed over workers)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.admission_rejections = Counter(
            "kvroute_admission_rejections",
            "Requests admission refused (503, or 429 for tenant_cap), by reason "
            "(saturated, queue_full, queue_timeout, tenant_cap, shed)",
            ["reason"],
            registry=r,
        )
        for refusal in Refusal:
            self.admission_rejections.labels(refusal)
        self.flow_queue = Gauge(
            "kvroute_flow_queue_depth",
            "Requests waiting in admission's queue now, by priority class (summed over workers)",
            ["class"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.flow_wait = Histogram(
            "kvroute_flow_queue_wait_seconds",
            "How long requests that waited in admission's queue waited, by priority class",
            ["class"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        for name in PRIORITIES:
            self.flow_queue.labels(name)
            self.flow_wait.labels(name)
        self.flow_tenant_queue = Gauge(
            "kvroute_flow_tenant_queue_depth",
            f"Requests waiting in admission's queue now, by tenant ({OTHER_TENANT}: not a "
            f"known one, {NO_TENANT}: none; summed over workers)",
            ["tenant"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.flow_tenant_wait = Histogram(
            "kvroute_flow_tenant_queue_wait_seconds",
            "How long requests that waited in admission's queue waited, by tenant (as "
            "kvroute_flow_tenant_queue_depth names them)",
            ["tenant"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self._prime_flow_tenants((*self._tenants, OTHER_TENANT, NO_TENANT))

    def _prime_flow_tenants(self, tenants: Iterable[str]) -> None:
        """Create at 0 the queue's depth and wait series of each of `tenants`."""
        for tenant in tenants:
            self.flow_tenant_queue.labels(tenant)
            self.flow_tenant_wait.labels(tenant)
