"""The policy's pick over the model's view, without the backends already tried; and a
request's first attempt begun under the workers' pick lock (`Fleet.picking`), so that
it is counted in the shared load before another worker picks.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Collection

from policies import FleetView, Pick, Reason, RouteRequest
from policies.least_outstanding_requests import least_loaded
from router.config import SaturationConfig
from router.dispatch.accounting import Accounting
from router.dispatch.attempt import Attempt, Attempts
from router.dispatch.call import Call, Routed
from router.dispatch.saturation import room_at
from router.dispatch.session import Sessions
from router.dispatch.upkeep import Upkeep
from router.errors import NoBackendAvailable
from router.fleet.backend import Backend
from router.fleet.backends import Fleet
from router.fleet.speeds import speed_prior
from router.upstream.retry import excluding


class Picker:
    """The fleet's current policy, asked for a backend (the policy changes on reload)."""

    __slots__ = ("_account", "_attempts", "_fleet", "_rng", "_upkeep", "saturation", "sessions")

    def __init__(
        self, fleet: Fleet, account: Accounting, attempts: Attempts, sessions: Sessions
    ) -> None:
        self._fleet = fleet
        self._account = account
        self._attempts = attempts
        self._rng = random.Random()
        #: the policies' index inserts left pending by their picks, drained between requests
        self._upkeep = Upkeep()
        #: session affinity, steering each request's first pick
        self.sessions = sessions
        #: flow control's saturation settings now (a reload changes them)
        self.saturation = SaturationConfig()

    def first(
        self, route_req: RouteRequest, t0: float, call: Call, timeout: asyncio.Timeout
    ) -> Attempt:
        """The pick for `call` (towards its session's backend, if it names one) and
        its attempt, begun while the pick lock is held."""
        session = self.sessions.session_of(call.headers) if call.role != "decode" else None
        self._fleet.catch_up()
        with self._fleet.picking():
            routed = self.pick(route_req, t0, (), call.role, session)
            if call.role == "decode":
                self._fleet.decodes.append(
                    (time.time(), route_req.model, call.prefilled_by or "", routed.backend.name)
                )
            return self._attempts.begin(routed, call, timeout)

    def pick(
        self,
        route_req: RouteRequest,
        t0: float,
        tried: Collection[str] = (),
        role: str | None = None,
        session: str | None = None,
    ) -> Routed:
        """The policy's pick for a described request, none named in `tried`, in the
        pools of `role` if given; `t0`: when its decision began. NoBackendAvailable (a
        503) if there is none. A decode (its prompt prefilled elsewhere) balances on
        decode load: the decode backend with the fewest requests in flight."""
        fleet = self._fleet
        pick, view, passed = self._first_with_room(route_req, tried, role, session)
        if fleet.pools:
            self._account.pooled(passed, pick)
        self._account.decided(pick, view.panic, t0)
        if pick.backend is None:
            raise NoBackendAvailable(unavailable(route_req.model), retry_after=1)
        backend = pick.backend
        return Routed(
            backend,
            pick.reason,
            route_req.prompt_tokens,
            pick.predicted_cached,
            backend.queued_tokens,
            backend.inflight,
            route_req.blocks,
        )

    def _first_with_room(
        self,
        route_req: RouteRequest,
        tried: Collection[str],
        role: str | None,
        session: str | None = None,
    ) -> tuple[Pick, FleetView, list[tuple[str, bool]]]:
        """The pick of the first pool (by priority) where the policy finds a backend
        below its cap, its view, and the pools passed on before it (name, and whether
        it had a backend: saturated, or none usable). Each pool's own policy judges its
        saturation (`Fleet.policy_of`). When every pool is saturated, the most preferred
        one with a backend takes the request, as a flat fleet's saturated pick does. A
        flat fleet is one pool without a name."""
        fleet = self._fleet
        passed: list[tuple[str, bool]] = []
        saturated: tuple[Pick, FleetView, list[tuple[str, bool]]] | None = None
        for pool, view in fleet.pool_views(route_req.model, role):  # cached
            policy = fleet.policy_of(pool)
            choose = self._least_loaded if role == "decode" else policy.pick
            pick = choose(route_req, excluding(view, tried) if tried else view)
            made = [pick]
            if pick.backend is not None and self.saturation.enabled:
                pick = self._with_room(pick, view, choose, route_req, made)
            if session is not None and pick.backend is not None:
                costed = speed_prior(policy.params) is not None
                pick = self._steered(session, pick, view, choose, route_req, made, costed)
            for other in made:
                if other.backend is not pick.backend:
                    policy.retract(route_req, other)
            self._upkeep.note(policy)
            if pick.backend is not None and pick.reason is not Reason.ALL_SATURATED:
                return pick, view, passed
            if pick.backend is not None and saturated is None:
                saturated = (pick, view, list(passed))
            if pool is not None:
                passed.append((pool.name, pick.backend is not None))
        return saturated if saturated is not None else (pick, view, [])

    def _with_room(
        self,
        pick: Pick,
        view: FleetView,
        choose: Callable[[RouteRequest, FleetView], Pick],
        route_req: RouteRequest,
        made: list[Pick],
    ) -> Pick:
        """The pick again among the candidates with room, when the policy's has none
        (saturation.py) and another has: a request admitted because the fleet has room
        must not wait in a full backend's queue, unless the pick there reaches a longer
        cached prefix than the pick with room (more tokens predicted, or `warm` against
        cold): the policy weighed that backend's load against the prefill a move adds
        (KV_AWARE's cost, PREFIX_AWARE's bound), and a move re-prefills the prefix,
        loading the backend with room too (on a burst of new long documents every holder
        queues at once, and moving their next requests spread each document over the
        fleet). A pick with room costs one check. Each pick made is added to `made`
        (those not followed are retracted)."""
        cfg = self.saturation
        if room_at(pick.backend, cfg, probe=True) > 0:
            return pick
        full = [b.name for b in view.candidates if room_at(b, cfg, probe=True) <= 0]
        if len(full) == len(view.candidates):
            return pick
        made.append(again := choose(route_req, excluding(view, full)))
        cached = (pick.predicted_cached, pick.warm) > (again.predicted_cached, again.warm)
        return pick if cached else again

    def _steered(
        self,
        session: str,
        pick: Pick,
        view: FleetView,
        choose: Callable[[RouteRequest, FleetView], Pick],
        route_req: RouteRequest,
        made: list[Pick],
        costed: bool,
    ) -> Pick:
        """The pick steered to the session's backend (session.py); each pick made is
        added to `made`. `costed`: the policy weighs each backend's cost."""

        def alone(backend: Backend) -> Pick:
            others = [b.name for b in view.candidates if b is not backend]
            made.append(there := choose(route_req, excluding(view, others)))
            return there

        return self.sessions.steer(session, pick, view.candidates, alone, costed)

    def _least_loaded(self, route_req: RouteRequest, view: FleetView) -> Pick:
        backend = least_loaded(view.candidates, self._rng)
        return Pick(backend, Reason.LEAST_OUTSTANDING if backend else Reason.NO_CANDIDATE)


def unavailable(model: str) -> str:
    """The message of a 503 for `model`."""
    which = f" for model `{model}`" if model else " (the request named no model)"
    return f"No backend is available{which}; retry shortly."
