"""Each tenant's requests in the router, admitted and waiting, against its fair share of
the fleet's learned batch slots: who may take the fleet's reserved room (flow.py).

A tenant's share is its weight over the weights of the tenants with requests in the
router now, times the fleet's slots; it counts as under it below twice that (`BURST`).
A quiet tenant beside a noisy one is under its share, the noisy one far over it; a
tenant alone with a backlog of more than the fleet's slots is over it. Router-wide: a
tenant's requests are the count admission keeps under its key (counts.py: every
worker's, with several), and the weights present are the flow signals' (signals.py).
Cost: O(1) per request.
"""

from __future__ import annotations

from collections.abc import Callable

from router.dispatch.counts import Counts

#: how far past its share a tenant's requests may be and still count as under it
BURST = 2.0


class Shares:
    """The tenants with requests in this worker and their weights, published to the
    others; each tenant's requests are counted by admission (`counts`)."""

    def __init__(self, weight: Callable[[str], float], counts: Counts) -> None:
        """`weight`: a tenant's weight now (a reload changes them)."""
        self._weight = weight
        self._counts = counts
        self._present: dict[str, int] = {}
        self._weights = 0.0

    def arrive(self, tenant: str) -> None:
        count = self._present.get(tenant, 0)
        if not count:
            self._weigh(self._weights + self._weight(tenant))
        self._present[tenant] = count + 1

    def depart(self, tenant: str) -> None:
        count = self._present[tenant] - 1
        if count:
            self._present[tenant] = count
        else:  # bounded: only tenants with requests here
            del self._present[tenant]
            self._weigh(self._weights - self._weight(tenant))

    def reweigh(self) -> None:
        """Recount the present tenants' weights (after a reload changed them)."""
        self._weigh(sum(self._weight(tenant) for tenant in self._present))

    def _weigh(self, weights: float) -> None:
        self._weights = weights
        self._counts.cells.set_weights(weights)

    def under(self, tenant: str, slots: int) -> bool:
        """Has `tenant` fewer requests in the router than twice its share of `slots`? A
        tenant that keeps to its share on average (a request rate) still bursts past it
        at times: twice is the margin, and a backlog is far beyond it."""
        weights = self._counts.cells.weights()
        mine = self._weight(tenant)
        share = slots * mine / weights if weights > 0 else slots
        return self._counts.count(self._counts.key(tenant)) < BURST * share
