"""A circuit breaker per backend: passive ejection from the request path's own outcomes.

States and moves (`BreakerConfig` gives the numbers):

  CLOSED    every attempt's verdict counts; `failure_threshold` consecutive failures
            (connection error, timeout, 5xx, a stream cut by the backend) → OPEN.
            Any success resets the count, so a slow but answering backend stays in.
  OPEN      no new attempts; after `open_seconds` the owner calls `half_open()`.
  HALF_OPEN one trial attempt at a time is admitted; only the trial's verdict counts:
            `half_open_successes` consecutive successes → CLOSED, a failure → OPEN.

Invariants: a verdict is applied at most once per attempt (the caller keeps the trial
flag `begin()` returned and passes it back); verdicts of attempts that started in an
earlier state are ignored outside CLOSED, so a slow failure from before the breaker
opened cannot re-open it after recovery. A trial that ends without a verdict (the
client left first) frees the trial slot and changes nothing else.

Pure: no clock and no I/O. The owner (`backends.Fleet`) schedules the OPEN → HALF_OPEN
timer and rebuilds the routing views whenever `admits` may have changed. Cost: O(1).
"""

from __future__ import annotations

from enum import StrEnum

from router.config import BreakerConfig


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    __slots__ = ("cfg", "failures", "state", "successes", "trial_busy")

    def __init__(self, cfg: BreakerConfig) -> None:
        self.cfg = cfg
        self.state = BreakerState.CLOSED
        self.failures = 0
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

    def record(self, ok: bool | None, trial: bool) -> BreakerState | None:
        """Apply one attempt's verdict (None: it ended without one).

        Returns the new state when it changed, else None.
        """
        if trial:
            self.trial_busy = False
        if ok is None or not self.cfg.enabled:
            return None
        if self.state is BreakerState.CLOSED:
            return self._closed(ok)
        if self.state is BreakerState.HALF_OPEN and trial:
            return self._half_open(ok)
        return None

    def half_open(self) -> BreakerState | None:
        """The open period is over: admit one trial. None if it was not OPEN any more."""
        if self.state is not BreakerState.OPEN:
            return None
        self.state, self.successes, self.trial_busy = BreakerState.HALF_OPEN, 0, False
        return self.state

    def _closed(self, ok: bool) -> BreakerState | None:
        if ok:
            self.failures = 0
            return None
        self.failures += 1
        return self._open() if self.failures >= self.cfg.failure_threshold else None

    def _half_open(self, ok: bool) -> BreakerState | None:
        if not ok:
            return self._open()
        self.successes += 1
        if self.successes < self.cfg.half_open_successes:
            return None
        self.state, self.failures = BreakerState.CLOSED, 0
        return self.state

    def _open(self) -> BreakerState:
        self.state, self.failures, self.successes = BreakerState.OPEN, 0, 0
        return self.state
