"""A job store's failures, as one worker meets them.

Every call to the store goes through `GuardedStore`. A failure of the store itself
(the store's `reason` names it: a full disk, a database locked past its busy timeout,
corrupt or gone, Redis away) becomes StoreUnavailable, a 503 with that reason and
Retry-After, never a 500 with a traceback. `StoreFaults` counts it by operation
(kvroute_job_store_errors_total{op}), logs it a few times a window (a full disk fails
every call), and keeps it until a call succeeds again: meanwhile the worker's /ready
body says so and kvroute_job_store_unavailable is 1. /ready stays 200: interactive
requests need no job store, so a store that fails must not take them out of rotation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from router import log
from router.errors import StoreUnavailable
from router.jobs.store import JobStore
from router.metrics import Metrics

#: lines a failing store may log per window, then one that says how many were left out
_LOG_BURST, _LOG_WINDOW_S = 5, 30.0


class StoreFaults:
    """The store's last failure, until a call succeeds; counted and logged (throttled)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._log = log.Throttled(log.server, _LOG_BURST, _LOG_WINDOW_S)
        #: what failed last and since when (wall time), while nothing succeeded since
        self.failing: tuple[str, float] | None = None

    def failed(self, op: str, reason: str) -> None:
        self._metrics.job_store_errors.labels(op).inc()
        self._log.warning("jobs: the store failed (%s): %s", op, reason)
        if self.failing is None:
            self._metrics.job_store_unavailable.set(1)
            self.failing = (reason, time.time())
        else:
            self.failing = (reason, self.failing[1])

    def answered(self) -> None:
        failing = self.failing
        if failing is not None:
            self.failing = None
            self._metrics.job_store_unavailable.set(0)
            log.server.warning("jobs: the store answers again, %.0f s on", time.time() - failing[1])

    def describe(self) -> dict[str, object]:
        """The store's state for /ready's body."""
        if self.failing is None:
            return {"store": "ok"}
        reason, since = self.failing
        return {"store": "unavailable", "reason": reason, "since": int(since)}


class GuardedStore:
    """`store` whose failures are StoreUnavailable, and noted in `faults`; otherwise the
    same calls (it is a JobStore)."""

    def __init__(self, store: JobStore, faults: StoreFaults) -> None:
        self._store = store
        self._faults = faults

    def __getattr__(self, op: str) -> Callable[..., Any]:
        call = getattr(self._store, op)
        if not callable(call):
            return call
        store, faults = self._store, self._faults

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                found = call(*args, **kwargs)
            except store.errors as exc:
                reason = store.reason(exc)
                faults.failed(op, reason)
                raise StoreUnavailable(f"The job store is unavailable: {reason}.") from exc
            faults.answered()
            return found

        return guarded
