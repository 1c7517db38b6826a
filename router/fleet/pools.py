"""Each pool's load, and how many of its backends could go without losing capacity.

What an autoscaler needs to drain the fallbacks first (GET /admin/pools and the
kvroute_pool_* gauges). The backends wanted are the fewest that carry what is in flight
now, taken from the preferred pool down, each pool's backends carrying its policy's
`concurrency_threshold` (a pool may set its own); where there is none, what a busy
backend carries now (so a fleet without thresholds wants as many as are busy). At
least one usable backend is always wanted, so an idle fleet keeps one in its
preferred pool. A pool's removable backends are its backends beyond those wanted of it.
Cost: O(backends), at a scrape or an admin call, never on the request path.
"""

from __future__ import annotations

import math

import msgspec

from router.fleet.backends import Fleet


class PoolState(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    #: None for a prefill or decode pool that sets none
    priority: int | None
    backends: int
    usable: int
    inflight: int
    #: in flight over the usable backends' capacity (None without a threshold)
    saturation: float | None
    wanted: int
    removable: int


def pool_states(fleet: Fleet) -> list[PoolState]:
    """The pools' states, preferred first; none for a flat fleet."""
    if not fleet.pools:
        return []
    members = fleet.members
    total = sum(b.inflight for b in members)
    busy = sum(1 for b in members if b.inflight)
    carried = total / busy if busy else 1.0  # what a busy backend carries, on average
    left = float(total)
    floor = 1  # an idle fleet keeps one backend, in its preferred pool
    states = []
    for pool in fleet.pools:
        cap = getattr(fleet.policy_of(pool).params, "concurrency_threshold", None)
        backends = [b for b in members if b.pool == pool.name]
        usable = sum(1 for b in backends if b.usable)
        inflight = sum(b.inflight for b in backends)
        wanted = min(usable, max(floor, math.ceil(left / (cap or carried))))
        left = max(0.0, left - wanted * (cap or carried))
        floor = 0 if wanted else floor
        states.append(
            PoolState(
                name=pool.name,
                priority=pool.priority,
                backends=len(backends),
                usable=usable,
                inflight=inflight,
                saturation=inflight / (usable * cap) if cap and usable else None,
                wanted=wanted,
                removable=len(backends) - wanted,
            )
        )
    return states
