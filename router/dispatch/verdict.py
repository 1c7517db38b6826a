"""The breaker's verdict on one attempt (attempt.py's docstring says when it is given):
at most one, and a server error's held until the request's fate says whose fault it
was (`defer`, `judge`)."""

from __future__ import annotations

from router.fleet.backend import Backend
from router.fleet.backends import Fleet
from router.fleet.breaker import Outcome
from router.metrics import Metrics


class Verdict:
    """The verdict part of `Attempt` (attempt.py), which sets this state with its own
    as it begins."""

    __slots__ = ("_deferred", "_fleet", "_held", "_judged", "_metrics", "_trial", "backend")

    _deferred: bool  # `judge` gives the held verdict, not `release`
    _fleet: Fleet
    _held: Outcome | None  # a server error's verdict, not given yet
    _judged: bool  # the breaker heard this attempt's verdict
    _metrics: Metrics
    _trial: bool  # the attempt is the breaker's half-open trial
    backend: Backend

    @property
    def server_error(self) -> bool:
        """It answered a server error whose verdict is held (`defer`, `judge`)."""
        return self._held is not None and not self._judged

    def defer(self) -> None:
        """Keep the held verdict past `release`: the request is retried elsewhere, and
        the next answer says whose fault the server error was (`judge`)."""
        self._deferred = True

    def judge(self, blamed: bool) -> None:
        """Give the held verdict: this backend's server error if `blamed`, else none
        (another backend answered the same request with one too: the request's fault)."""
        if not self.server_error:
            return
        if blamed:
            self._verdict(self._held)
        else:
            self._judged = True

    def _verdict(self, verdict: Outcome | None) -> None:
        if self._judged:
            return
        self._judged = verdict is not None
        if self._fleet.attempt_verdict(self.backend, verdict, self._trial):
            self._metrics.ejections_refused.labels(self.backend.name).inc()
        self._trial = False
