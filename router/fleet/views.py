"""The cached per-model `FleetView`s the policies pick from, with Envoy's panic mode.

`Fleet` caches one view per model and rebuilds the cache only when membership, health,
breakers, drain or model lists change (`changed`), so per-request work is a dict
lookup. Panic: when fewer than `panic_threshold_percent` of a model's backends (not
draining) are usable, its view takes every one that passes health checks, breaker open
or not, rather than answer 503. It is judged when a view is built, off the request path.
"""

from __future__ import annotations

import contextlib

from policies import FleetView, Policy
from router.config import BreakerConfig, PoolConfig
from router.fleet.backend import Backend
from router.fleet.placements import PlacementTable
from router.fleet.shared_load import LoadTable

_MAX_CACHED_VIEWS = 1024


class Views:
    """The views part of `Fleet` (backends.py): what the request path reads."""

    members: tuple[Backend, ...]
    policy: Policy
    placements: PlacementTable | None
    #: with several workers, their shared load table (whose turn ROUND_ROBIN takes)
    table: LoadTable | None
    #: the breakers' settings: the ejection cap and the panic threshold are the fleet's
    breaker_cfg: BreakerConfig
    _views: dict[str, FleetView]
    _models: frozenset[str] | None = None
    #: the pools, preferred first (none: one flat pool), and each model's view in each
    pools: tuple[PoolConfig, ...] = ()
    _pool_views: dict[tuple[str, str | None], tuple[tuple[PoolConfig, FleetView], ...]]

    def picking(self) -> contextlib.AbstractContextManager[object]:
        """Held around a pick and the count of its request in the shared load table: with
        several workers and a policy that learns from its picks (`Policy.shares_picks`),
        the placements' lock, so that the next worker's pick sees both where this one went
        and its load; else nothing to hold (a stateless pick need not wait for others)."""
        if self.placements is None or not self.policy.shares_picks:
            return contextlib.nullcontext()
        return self.placements

    def view(self, model: str) -> FleetView:
        view = self._views.get(model)
        if view is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views = {}  # bounded: clients choose model names
            view = self._views[model] = self._build_view(model)
        return view

    def pool_views(
        self, model: str, role: str | None = None
    ) -> tuple[tuple[PoolConfig | None, FleetView], ...]:
        """The view of `model` in each pool (of `role` only, if given), preferred first,
        each over the pool's backends serving the name its `model_map` gives; one
        (None, view) without pools."""
        if not self.pools:
            return ((None, self.view(model)),)
        found = self._pool_views.get((model, role))
        if found is None:
            if len(self._pool_views) >= _MAX_CACHED_VIEWS:
                self._pool_views = {}
            found = self._pool_views[(model, role)] = tuple(
                (pool, self._build_view(pool.model_map.get(model, model), pool.name))
                for pool in self.pools
                if role is None or pool.role == role
            )
        return found

    def has_role(self, role: str) -> bool:
        """Whether a pool has `role`."""
        return any(p.role == role for p in self.pools)

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode pools: chat and completion requests take both."""
        return self.has_role("prefill")

    def known_model(self, model: str) -> bool:
        """False when every backend's model list is known and none lists `model` (under
        its pool's name for it)."""
        if not self.pools:
            return any(b.serves(model) for b in self.members)
        named = {p.name: p.model_map.get(model, model) for p in self.pools}
        return any(b.serves(named.get(b.pool or "", model)) for b in self.members)

    @property
    def models(self) -> frozenset[str]:
        """Every model a member lists (configured or discovered) and every name a pool's
        `model_map` renames (what clients ask for: a name only a renamed pool serves
        is listed by no member), worked out once after each change: the values of the
        metrics' model label."""
        if self._models is None:
            listed = frozenset().union(*(b.models or () for b in self.members))
            self._models = listed.union(*(p.model_map for p in self.pools))
        return self._models

    def changed(self) -> None:
        """Health or model lists changed: drop the cached views and models."""
        self._views = {}
        self._pool_views = {}
        self._models = None

    def any_usable(self) -> bool:
        """Can requests be routed: a usable member, or (panic on) one that passes health
        checks, whatever its breaker says (with none usable, every view is in panic)."""
        panic = self.breaker_cfg.panic_threshold_percent > 0
        return any(b.usable or (panic and _alive(b)) for b in self.members)

    def _build_view(self, model: str, pool: str | None = None) -> FleetView:
        """The usable backends serving `model` (of `pool` only, if given); in panic,
        every one passing checks. Every view's members are the whole fleet's, so a
        policy's per-member state stays one (a ring, names by backend)."""
        serving = tuple(
            b
            for b in self.members
            if not b.draining and b.serves(model) and (pool is None or b.pool == pool)
        )
        candidates = usable = tuple(b for b in serving if b.usable)
        if len(usable) * 100 < self.breaker_cfg.panic_threshold_percent * len(serving):
            candidates = tuple(b for b in serving if _alive(b))
        panic = len(candidates) > len(usable)  # in panic only if it adds a backend
        names = frozenset(b.name for b in candidates)
        return FleetView(self.members, candidates, names, panic, self.table)


def _alive(backend: Backend) -> bool:
    """Passes active checks and is not draining: routable in panic, breaker or not."""
    return backend.healthy and not backend.draining
