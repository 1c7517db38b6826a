"""What makes a backend usable or not, and the fleet's guard against ejecting too many.

Three writers, each beside the path: the health checker (`set_healthy`; dispatch too,
when nothing listens), the request outcomes (`attempt_begins` / `attempt_verdict`, which
drive the breaker) and the operator (`set_draining`). Every change of usability drops
the cached views and counts a transition (exported at scrape time).

Envoy's ejection cap keeps passive ejection from emptying a fleet that is up: a breaker
may open only while at most `max_ejection_percent` of the members have theirs open or
half-open, counting it; past that `attempt_verdict` refuses the opening. Each worker has
its own breakers, so the cap holds per worker. It is judged when a breaker would open,
off the request path (panic, the other guard, is the views': views.py).
"""

from __future__ import annotations

import asyncio
import logging

from router import log
from router.fleet.backend import Backend
from router.fleet.breaker import BreakerState, Outcome
from router.fleet.views import Views

_RECOVERIES = frozenset({"up", "closed", "undrained"})


class Usability(Views):
    """The usability part of `Fleet` (backends.py)."""

    def set_healthy(self, backend: Backend, healthy: bool, why: str = "") -> None:
        """`why`: what the log line says of the change (the failing check's error)."""
        if backend.healthy != healthy:
            backend.healthy = healthy
            self._transition(backend, "up" if healthy else "down", why)

    def set_draining(self, backend: Backend, draining: bool) -> None:
        if backend.draining != draining:
            backend.draining = draining
            self._transition(backend, "draining" if draining else "undrained")

    def attempt_begins(self, backend: Backend) -> bool:
        """An attempt is sent to `backend`; True if it is the breaker's half-open trial."""
        trial = backend.breaker.begin()
        if trial:
            self.changed()  # no other attempt until the trial's verdict
        return trial

    def attempt_verdict(self, backend: Backend, verdict: Outcome | None, trial: bool) -> bool:
        """Feed an attempt's outcome to the breaker (None: ended without a verdict).

        True when the breaker would have opened but the ejection cap kept it closed.
        """
        breaker = backend.breaker
        admitted, before = breaker.admits, breaker.state
        state = breaker.record(verdict, trial)
        refused = state is BreakerState.OPEN and before is BreakerState.CLOSED and self._capped()
        if refused:
            breaker.refuse()
            state = None
        if state is BreakerState.OPEN:
            loop = asyncio.get_running_loop()
            loop.call_later(breaker.cfg.open_seconds, self._half_open, backend)
        if state is not None:
            self._transition(backend, f"breaker {state.value}", _breaker_why(state, verdict, trial))
        elif breaker.admits != admitted:
            self.changed()
        return refused

    def _capped(self) -> bool:
        """Are more members ejected (breaker not closed) than `max_ejection_percent`?
        O(fleet), only when a breaker opens."""
        ejected = sum(b.breaker.state is not BreakerState.CLOSED for b in self.members)
        return ejected * 100 > self.breaker_cfg.max_ejection_percent * len(self.members)

    def _half_open(self, backend: Backend) -> None:
        state = backend.breaker.half_open()
        if state is not None:
            why = f"open for {backend.breaker.cfg.open_seconds:g}s: one trial request next"
            self._transition(backend, f"breaker {state.value}", why)

    def _transition(self, backend: Backend, to: str, why: str = "") -> None:
        """Count the change (by the state entered) and log it, with why when known."""
        state = to.removeprefix("breaker ")
        backend.transitions[state] = backend.transitions.get(state, 0) + 1
        level = logging.INFO if state in _RECOVERIES else logging.WARNING
        reason = f" ({why})" if why else ""
        log.backends.log(level, "backend %s: %s%s", backend.name, to, reason)
        self.changed()


def _breaker_why(state: BreakerState, verdict: Outcome | None, trial: bool) -> str:
    """Why the breaker moved: the verdict that moved it."""
    if trial:
        return "its trial request " + ("succeeded" if verdict is Outcome.SUCCESS else "failed")
    kinds = {
        Outcome.FAILURE: "unavailable (502, 503, 504 or no answer)",
        Outcome.SERVER_ERROR: "a server error",
    }
    return f"failed requests in a row, the last: {kinds.get(verdict, 'failed')}"
