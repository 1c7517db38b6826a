"""ROUND_ROBIN: candidates in turn, one shared counter.

Reads FleetView.candidates, and FleetView.turns: with several worker processes the turn
is theirs together (each with its own, two requests reaching two of them at once went to
the same backend). Cost: O(1) (a sum over the workers' counts with several). With
per-model candidate lists the turn is shared across models, which keeps each list evenly
served on average.
YAML:  routing: {strategy: ROUND_ROBIN}
"""

import itertools

from policies.base import FleetView, Pick, Policy, PolicyParams, Reason, RouteRequest
from policies.registry import register


class RoundRobinParams(PolicyParams, tag="ROUND_ROBIN"):
    pass


@register
class RoundRobinPolicy(Policy[RoundRobinParams]):
    use_when = "the backends are alike and prompts share nothing"

    def __init__(self, params: RoundRobinParams) -> None:
        super().__init__(params)
        self._turn = itertools.count()

    def pick(self, req: RouteRequest, fleet: FleetView) -> Pick:
        if not fleet.candidates:
            return Pick(None, Reason.NO_CANDIDATE)
        turn = next(self._turn) if fleet.turns is None else fleet.turns.take()
        return Pick(fleet.candidates[turn % len(fleet.candidates)], Reason.ROUND_ROBIN)
