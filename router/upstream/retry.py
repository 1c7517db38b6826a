"""When a failed attempt is tried again elsewhere, and how long to wait first.

A retry is safe only while nothing has reached the client: dispatch asks this module
before it hands the response to the ingress, never after, so a generation is never
duplicated into a stream that already started. Retried: a connection that failed
before the backend answered (refused, reset, closed keep-alive), and the statuses in
`retry_on` (vLLM answers 503 when its queue is full; a 500 retried tells a request
that every backend fails on from a failing backend: router/dispatch/connect.py). Not
retried: timeouts (the backend may be generating; `first_byte` already waited long)
and every other status, which is passed through as the backend sent it.

The next backend is the policy's own next choice with the backends already tried taken
out of the candidates (`excluding`): PREFIX_AWARE walks on along the prefix's ring
order, LEAST_OUTSTANDING takes the next least loaded. At most `max_retries` retries,
each after an exponential backoff (`backoff` doubled per retry, capped at
`backoff_max`) scaled by a random factor in [0.5, 1) so a fleet-wide hiccup does not
come back as a synchronized wave.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Collection

from policies import FleetView
from router.config import RetryConfig


class RetryPolicy:
    __slots__ = ("_on", "_rng", "cfg")

    def __init__(self, cfg: RetryConfig, rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self._on = frozenset(cfg.retry_on)
        self._rng = rng or random.Random()

    def retryable_status(self, status: int) -> bool:
        return status in self._on

    def allows(self, attempts: int) -> bool:
        """May a request that made `attempts` attempts make one more?"""
        return attempts <= self.cfg.max_retries

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0 for the first)."""
        cfg = self.cfg
        return min(cfg.backoff_max, cfg.backoff * 2**retry) * (0.5 + self._rng.random() / 2)


def excluding(view: FleetView, tried: Collection[str]) -> FleetView:
    """`view` without the backends named in `tried` among its candidates."""
    candidates = tuple(b for b in view.candidates if b.name not in tried)
    return dataclasses.replace(
        view, candidates=candidates, candidate_names=view.candidate_names - frozenset(tried)
    )
