"""LEAST_OUTSTANDING_REQUESTS: the candidate with the fewest in-flight requests (router-wide).

Reads each candidate's `inflight` count (kept exact by the router's accounting). Ties
are broken uniformly at random, never by list order, so idle backends share new work
instead of the first one in the list absorbing it. Cost: O(candidates).
seed (int >= 0, default unset): fix the tie-breaking for reproducible benchmarks.
YAML:  routing: {strategy: LEAST_OUTSTANDING_REQUESTS}
"""

import random
from collections.abc import Sequence
from typing import Annotated

from msgspec import Meta

from policies.base import (
    BackendLike,
    FleetView,
    Pick,
    Policy,
    PolicyParams,
    Reason,
    RouteRequest,
)
from policies.registry import register


class LeastOutstandingRequestsParams(PolicyParams, tag="LEAST_OUTSTANDING_REQUESTS"):
    seed: Annotated[int, Meta(ge=0)] | None = None


def least_loaded(backends: Sequence[BackendLike], rng: random.Random) -> BackendLike | None:
    """The backend with the lowest in-flight count; ties by reservoir sampling (one pass)."""
    best: BackendLike | None = None
    best_load = 0
    ties = 0
    for backend in backends:
        load = backend.inflight
        if best is None or load < best_load:
            best, best_load, ties = backend, load, 1
        elif load == best_load:
            ties += 1
            if rng.randrange(ties) == 0:
                best = backend
    return best


@register
class LeastOutstandingRequestsPolicy(Policy[LeastOutstandingRequestsParams]):
    use_when = "prompts share nothing and their lengths vary a lot"

    def __init__(self, params: LeastOutstandingRequestsParams) -> None:
        super().__init__(params)
        self._rng = random.Random(params.seed)

    def pick(self, req: RouteRequest, fleet: FleetView) -> Pick:
        backend = least_loaded(fleet.candidates, self._rng)
        if backend is None:
            return Pick(None, Reason.NO_CANDIDATE)
        return Pick(backend, Reason.LEAST_OUTSTANDING)
