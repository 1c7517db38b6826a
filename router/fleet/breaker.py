"""A circuit breaker per backend: passive ejection from the request path's own outcomes.

What counts (`outcome`): a client must not be able to eject a healthy backend, so only
what the backend cannot blame on the request is a FAILURE: a connection error, a
timeout, a stream it cut, a 502, 503 or 504. A 500 (and any other 5xx but 501 and 505)
is a SERVER_ERROR: a malformed body can provoke one from a healthy vLLM, so it counts
as `server_error_weight` of a failure (0.1: ten in a row weigh one failure). When the
request is retried, another backend's answer judges it first: a 500 there too is the
request's fault, and no breaker hears either (router/dispatch/connect.py).
Any other answer is a SUCCESS: 4xx (the client's), 501 and 505 (what the request asks
for).

States and moves (`BreakerConfig` gives the numbers):

  CLOSED    every attempt's verdict counts; failures and weighted server errors in a
            row weighing `failure_threshold` → OPEN. Any success resets the count, so a
            slow but answering backend stays in.
  OPEN      no new attempts; after `open_seconds` the owner calls `half_open()`.
  HALF_OPEN one trial attempt at a time is admitted; only the trial's verdict counts:
            `half_open_successes` consecutive successes → CLOSED, trial verdicts that
            weigh one failure (a failure, or 1 / weight server errors) → OPEN.

The owner may refuse an opening (`refuse`: Envoy's maximum ejection percent, which
needs the whole fleet's states): the breaker stays CLOSED with its count reset.

Invariants: a verdict is applied at most once per attempt (the caller keeps the trial
flag `begin()` returned and passes it back); verdicts of attempts that started in an
earlier state are ignored outside CLOSED, so a slow failure from before the breaker
opened cannot re-open it after recovery. A trial that ends without a verdict (the
client left first) frees the trial slot and changes nothing else.

Pure: no clock and no I/O. The owner (`backends.Fleet`) schedules the OPEN → HALF_OPEN
timer and rebuilds the routing views whenever `admits` may have changed. Cost: O(1).
"""

from __future__ import annotations

from enum import Enum, StrEnum

from router.config import BreakerConfig

#: statuses of a backend that is there but cannot serve: overloaded, or a gateway's
_UNAVAILABLE = frozenset({502, 503, 504})
#: 5xx that say what the request asks for is not served (method, HTTP version): no fault
_UNSUPPORTED = frozenset({501, 505})


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Outcome(Enum):
    """One attempt's verdict, as the breaker weighs it."""

    SUCCESS = "success"
    FAILURE = "failure"
    SERVER_ERROR = "server_error"


def outcome(status: int) -> Outcome:
    """The verdict of an answer with HTTP `status` (see the module docstring)."""
    if status < 500 or status in _UNSUPPORTED:
        return Outcome.SUCCESS
    return Outcome.FAILURE if status in _UNAVAILABLE else Outcome.SERVER_ERROR


class Breaker:
    __slots__ = ("cfg", "failures", "server_errors", "state", "successes", "trial_busy")

    def __init__(self, cfg: BreakerConfig) -> None:
        self.cfg = cfg
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.server_errors = 0
        self.successes = 0
        self.trial_busy = False

    @property
    def admits(self) -> bool:
        """May a new attempt be sent? (CLOSED, or HALF_OPEN with the trial slot free.)"""
        state = self.state
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self.trial_busy
        )

    def begin(self) -> bool:
        """An attempt starts; True when it is the half-open trial (it takes the slot)."""
        if self.state is BreakerState.HALF_OPEN and not self.trial_busy:
            self.trial_busy = True
            return True
        return False

    def record(self, verdict: Outcome | None, trial: bool) -> BreakerState | None:
        """Apply one attempt's verdict (None: it ended without one).

        Returns the new state when it changed, else None.
        """
        if trial:
            self.trial_busy = False
        if verdict is None or not self.cfg.enabled:
            return None
        if self.state is BreakerState.CLOSED:
            return self._closed(verdict)
        if self.state is BreakerState.HALF_OPEN and trial:
            return self._half_open(verdict)
        return None

    def half_open(self) -> BreakerState | None:
        """The open period is over: admit one trial. None if it was not OPEN any more."""
        if self.state is not BreakerState.OPEN:
            return None
        self.state, self.successes, self.trial_busy = BreakerState.HALF_OPEN, 0, False
        return self.state

    def refuse(self) -> None:
        """The owner refuses the opening `record` just made (the ejection cap): CLOSED
        again with the count reset, so another `failure_threshold` asks again."""
        self._reset(BreakerState.CLOSED)

    def _closed(self, verdict: Outcome) -> BreakerState | None:
        if verdict is Outcome.SUCCESS:
            self.failures = self.server_errors = 0
            return None
        self._count(verdict)
        return self._open() if self._weighs(self.cfg.failure_threshold) else None

    def _half_open(self, verdict: Outcome) -> BreakerState | None:
        if verdict is not Outcome.SUCCESS:
            self._count(verdict)
            return self._open() if self._weighs(1) else None
        self.successes += 1
        if self.successes < self.cfg.half_open_successes:
            return None
        self._reset(BreakerState.CLOSED)
        return self.state

    def _count(self, verdict: Outcome) -> None:
        if verdict is Outcome.FAILURE:
            self.failures += 1
        else:
            self.server_errors += 1

    def _weighs(self, threshold: int) -> bool:
        """Do the failures counted weigh `threshold`? (Integers until the one product,
        so ten server errors of weight 0.1 weigh exactly one failure.)"""
        return self.failures + self.server_errors * self.cfg.server_error_weight >= threshold

    def _open(self) -> BreakerState:
        self._reset(BreakerState.OPEN)
        return self.state

    def _reset(self, state: BreakerState) -> None:
        self.state, self.failures, self.server_errors, self.successes = state, 0, 0, 0
