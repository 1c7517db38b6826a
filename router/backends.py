"""Backend state and the per-model `FleetView` snapshots policies read.

A `Backend` holds what routing needs: identity, weight, the models it serves, whether
it is usable, and the router-local in-flight count (the accounting in dispatch keeps it
exact). `Fleet` caches one `FleetView` per model and rebuilds the cache only when
membership, health or model lists change, so per-request work is a dict lookup.
Telemetry loops write here; the request path only reads and counts.
"""

from __future__ import annotations

from collections.abc import Iterable

from yarl import URL

from policies import FleetView, Policy
from router.config import BackendConfig

_MAX_CACHED_VIEWS = 1024


class Backend:
    __slots__ = (
        "configured_models",
        "discovered_models",
        "healthy",
        "inflight",
        "model_cards",
        "name",
        "url",
        "weight",
    )

    def __init__(self, cfg: BackendConfig) -> None:
        self.name = cfg.key
        self.url = URL(cfg.url)
        self.weight = cfg.weight
        self.configured_models = frozenset(cfg.models) if cfg.models else None
        self.discovered_models: frozenset[str] | None = None
        self.model_cards: list[dict] = []
        self.healthy = True
        self.inflight = 0

    @property
    def models(self) -> frozenset[str] | None:
        """Models served, or None while unknown (then it is a candidate for any model)."""
        return self.configured_models or self.discovered_models

    def serves(self, model: str) -> bool:
        models = self.models
        return not model or models is None or model in models

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, inflight={self.inflight}, healthy={self.healthy})"


class Fleet:
    """The configured backends and the cached per-model views over them."""

    def __init__(self, configs: Iterable[BackendConfig], policy: Policy) -> None:
        self.members: tuple[Backend, ...] = tuple(Backend(c) for c in configs)
        self.policy = policy
        self._views: dict[str, FleetView] = {}
        policy.on_fleet_change(self.members)

    def view(self, model: str) -> FleetView:
        view = self._views.get(model)
        if view is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views = {}  # bounded: clients choose model names
            view = self._views[model] = self._build_view(model)
        return view

    def known_model(self, model: str) -> bool:
        """False when every backend's model list is known and none lists `model`."""
        return any(b.serves(model) for b in self.members)

    def changed(self) -> None:
        """Health or model lists changed: drop the cached views."""
        self._views = {}

    def set_healthy(self, backend: Backend, healthy: bool) -> None:
        if backend.healthy != healthy:
            backend.healthy = healthy
            self.changed()

    def set_discovered(self, backend: Backend, cards: list[dict]) -> None:
        models = frozenset(str(c.get("id", "")) for c in cards if isinstance(c, dict))
        backend.model_cards = cards
        if models != backend.discovered_models:
            backend.discovered_models = models
            self.changed()

    def any_usable(self) -> bool:
        return any(b.healthy for b in self.members)

    def total_inflight(self) -> int:
        return sum(b.inflight for b in self.members)

    def _build_view(self, model: str) -> FleetView:
        candidates = tuple(b for b in self.members if b.healthy and b.serves(model))
        return FleetView(self.members, candidates, frozenset(b.name for b in candidates))
