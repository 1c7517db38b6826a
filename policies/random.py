"""RANDOM: a uniformly random candidate backend (the managed service's default).

Reads FleetView.candidates only. Cost: O(1).
seed (int >= 0, default unset): fix it for reproducible benchmarks.
YAML:  routing: {strategy: RANDOM, seed: 7}
"""

import random
from typing import Annotated

from msgspec import Meta

from policies.base import FleetView, Pick, Policy, PolicyParams, Reason, RouteRequest
from policies.registry import register


class RandomParams(PolicyParams, tag="RANDOM"):
    seed: Annotated[int, Meta(ge=0)] | None = None


@register
class RandomPolicy(Policy[RandomParams]):
    use_when = "you want a baseline to compare the others against"

    def __init__(self, params: RandomParams) -> None:
        super().__init__(params)
        self._rng = random.Random(params.seed)

    def pick(self, req: RouteRequest, fleet: FleetView) -> Pick:
        if not fleet.candidates:
            return Pick(None, Reason.NO_CANDIDATE)
        return Pick(self._rng.choice(fleet.candidates), Reason.RANDOM)
