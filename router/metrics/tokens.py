"""The tokens answers report (their `usage`) and the answers counted, by model, tenant
and pool (cost allocation; router/usage_records.py keeps the same counts by time window,
each tenant by its id, where these labels bound tenants); the access log's lost lines
and the data capture's records."""

from __future__ import annotations

from collections.abc import Container, Iterable

from prometheus_client import CollectorRegistry, Counter

from router.metrics.hot_path import Labelled

#: the tenant label of a request with no tenant (no auth, no tenant header)
NO_TENANT = "(none)"
#: the pool label of a backend in a flat fleet
NO_POOL = "(none)"
#: the label of a value past a bounded label's first ones, or not a known one
OTHER = "(other)"
TOKEN_KINDS = ("prompt", "cached", "completion")


class TokenMetrics:
    """The token counters of `Metrics`."""

    _tenants: frozenset[str]

    def _declare_tokens(self, r: CollectorRegistry) -> None:
        self.tokens = Counter(
            "kvroute_tokens",
            "Tokens the answers reported in their usage, by kind (prompt, cached: the part "
            "of the prompt served from the KV cache, completion), model, tenant and pool",
            ["kind", "model", "tenant", "pool"],
            registry=r,
        )
        self._token_children = Labelled(self.tokens)
        self.usage_requests = Counter(
            "kvroute_usage_requests",
            "Answers whose usage kvroute_tokens_total counted, by model, tenant and pool",
            ["model", "tenant", "pool"],
            registry=r,
        )
        self._usage_children = Labelled(self.usage_requests)
        self.access_log_dropped = Counter(
            "kvroute_access_log_dropped",
            "Access log lines lost: the writer fell behind, or the write failed",
            registry=r,
        )
        self.capture_written = Counter(
            "kvroute_capture_records",
            "Requests the data capture wrote, one JSON line each",
            registry=r,
        )
        self.capture_dropped = Counter(
            "kvroute_capture_dropped",
            "Captured requests lost, by reason: queue_full (the writer fell behind; the "
            "request never waits for it) or write_error",
            ["reason"],
            registry=r,
        )

    def _prime_tokens(self, served: Iterable[tuple[str, str | None]], named: Iterable[str]) -> None:
        """Create at 0 the token and answer counters of each (model, pool) `served`, for
        the tenants `named` (`metrics.tenants`, the static tokens'), others and none."""
        tenants = (*named, OTHER, NO_TENANT)
        for model, pool in served:
            for tenant in tenants:
                self._usage_children(model, tenant, pool or NO_POOL)
                for kind in TOKEN_KINDS:
                    self._token_children(kind, model, tenant, pool or NO_POOL)

    def count_tokens(
        self,
        model: str,
        tenant: str,
        pool: str | None,
        prompt: int | None,
        cached: int | None,
        completion: int | None,
    ) -> None:
        """Add one answer's reported counts (None: not reported); `model`: its label
        (`model_label`), `tenant` its (`tenant_label`)."""
        labels = (model, tenant, pool or NO_POOL)
        self._usage_children(*labels).inc()
        child = self._token_children
        if prompt:
            child("prompt", *labels).inc(prompt)
        if cached:
            child("cached", *labels).inc(cached)
        if completion:
            child("completion", *labels).inc(completion)

    def tenant_label(self, tenant: str | None, known: Container[str]) -> str:
        """`tenant` if the config or the static tokens name it, else OTHER (NO_TENANT: none)."""
        if tenant is None:
            return NO_TENANT
        return tenant if tenant in self._tenants or tenant in known else OTHER
