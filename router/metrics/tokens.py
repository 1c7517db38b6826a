"""The tokens answers report (their `usage`), by model and tenant; the access log's lost
lines and the data capture's records."""

from __future__ import annotations

from collections.abc import Container, Iterable

from prometheus_client import CollectorRegistry, Counter

from router.metrics.hot_path import Labelled

#: the tenant label of a request with no tenant (no auth, no tenant header)
NO_TENANT = "(none)"
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
            "of the prompt served from the KV cache, completion), model and tenant",
            ["kind", "model", "tenant"],
            registry=r,
        )
        self._token_children = Labelled(self.tokens)
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

    def _prime_tokens(self, models: Iterable[str]) -> None:
        """Create at 0 the token counters of `models` (each kind) for the tenants named
        by `metrics.tenants`, for others and for none."""
        tenants = (*self._tenants, OTHER, NO_TENANT)
        for model in models:
            for kind in TOKEN_KINDS:
                for tenant in tenants:
                    self._token_children(kind, model, tenant)

    def count_tokens(
        self,
        model: str,
        tenant: str | None,
        known_tenants: Container[str],
        prompt: int | None,
        cached: int | None,
        completion: int | None,
    ) -> None:
        """Add one answer's reported counts (None: not reported); `model`: its label
        (`model_label`)."""
        labels = (model, self.tenant_label(tenant, known_tenants))
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
