"""The tokens answers report (their `usage`), by model and tenant, and the access log's
lost lines."""

from __future__ import annotations

from collections.abc import Container

from prometheus_client import CollectorRegistry, Counter

from router.metrics.hot_path import Labelled

#: the tenant label of a request with no tenant (no auth, no tenant header)
NO_TENANT = "(none)"
#: the label of a value past a bounded label's first ones, or not a known one
OTHER = "(other)"
#: how many distinct models get a label of their own (when the backends do not list
#: theirs, the model check lets any name through: the first ones seen are kept)
MAX_MODELS = 64
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
        self._models: dict[str, str] = {}  # insertion-ordered, bounded
        self.access_log_dropped = Counter(
            "kvroute_access_log_dropped",
            "Access log lines lost: the writer fell behind, or the write failed",
            registry=r,
        )

    def count_tokens(
        self,
        model: str,
        tenant: str | None,
        known_tenants: Container[str],
        prompt: int | None,
        cached: int | None,
        completion: int | None,
    ) -> None:
        """Add one answer's reported counts (None: not reported)."""
        labels = (self.model_label(model), self.tenant_label(tenant, known_tenants))
        child = self._token_children
        if prompt:
            child("prompt", *labels).inc(prompt)
        if cached:
            child("cached", *labels).inc(cached)
        if completion:
            child("completion", *labels).inc(completion)

    def model_label(self, model: str) -> str:
        """`model` if it is one of the first MAX_MODELS names seen, else OTHER."""
        if model in self._models or len(self._models) < MAX_MODELS:
            self._models[model] = model
            return model
        return OTHER

    def tenant_label(self, tenant: str | None, known: Container[str]) -> str:
        """`tenant` if the config or the static tokens name it, else OTHER (NO_TENANT: none)."""
        if tenant is None:
            return NO_TENANT
        return tenant if tenant in self._tenants or tenant in known else OTHER
