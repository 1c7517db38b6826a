"""Each pool's settings as the fleet applies them: the policy tuned to a pool's own
parameters, and the model names a pool's `model_map` renames (the backend's name sent,
the client's name answered unless the pool exposes the backend's).

A base of `Fleet` (backends.py), as usability.py and views.py are: `Fleet` holds the
state these read (`pools`, `policy`, `members`) and attaches each tuned policy.
"""

from __future__ import annotations

from collections.abc import Iterable

from policies import Policy
from router.config import PoolConfig, pools_in_order
from router.fleet.backend import Backend
from router.fleet.usability import Usability


class PoolSettings(Usability):
    """The pool settings part of `Fleet` (backends.py)."""

    def set_pools(self, pools: Iterable[PoolConfig]) -> None:
        """The pools, preferred first (a reload may change them; none: a flat fleet)."""
        self.pools = tuple(pools_in_order(pools))
        self._model_maps = {p.name: p.model_map for p in self.pools if p.model_map}
        self._public = {
            p.name: _inverse(p.model_map)
            for p in self.pools
            if p.model_map and not p.expose_backend_model
        }
        self._tune(self.policy, self.members)
        self.changed()

    def policy_of(self, pool: PoolConfig | None) -> Policy:
        """The policy that picks in `pool`: the fleet's, tuned to the pool's own
        parameters when it sets some."""
        if pool is None or not self._pool_policies:
            return self.policy
        return self._pool_policies.get(pool.name, self.policy)

    def _tune(self, policy: Policy, members: tuple[Backend, ...]) -> None:
        """A tuned twin of `policy` for each pool with parameters of its own (checked
        with the config, so this cannot fail for pools the config holds)."""
        self._pool_policies = {}
        for pool in self.pools:
            if pool.routing:
                twin = policy.tuned(pool.params(policy.params))
                self._attach(twin, members)
                self._pool_policies[pool.name] = twin

    def renamed(self, backend: Backend, model: str | None) -> str | None:
        """The name `backend`'s pool serves `model` under, when its `model_map` renames
        it; None: the client's name stands."""
        if not self._model_maps or backend.pool is None or model is None:
            return None
        return self._model_maps.get(backend.pool, {}).get(model)

    def answers_as_asked(self, backend: Backend) -> bool:
        """Whether an answer `backend` gives under a renamed model is to name the model
        the client asked for (its pool does not `expose_backend_model`)."""
        return backend.pool in self._public

    def public_names(self, backend: Backend) -> dict[str, tuple[str, ...]]:
        """The names clients know `backend`'s models by, for each model its pool's
        `model_map` renames and does not expose (/v1/models lists these)."""
        return self._public.get(backend.pool, {}) if backend.pool is not None else {}


def _inverse(model_map: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """The client's names of each backend's name a `model_map` gives."""
    found: dict[str, tuple[str, ...]] = {}
    for asked, served in model_map.items():
        found[served] = (*found.get(served, ()), asked)
    return found
