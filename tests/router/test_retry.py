"""The retry policy: budget, retryable statuses, backoff; and the view without tried backends."""

from __future__ import annotations

import random

import pytest

from policies import FleetView
from router.config import RetryConfig
from router.upstream.retry import RetryPolicy, excluding


@pytest.mark.parametrize(
    ("retry", "low", "high"),
    [
        pytest.param(0, 0.05, 0.1, id="first"),
        pytest.param(1, 0.1, 0.2, id="doubled"),
        pytest.param(5, 0.25, 0.5, id="capped"),
    ],
)
def test_backoff_is_exponential_capped_and_jittered(retry: int, low: float, high: float) -> None:
    policy = RetryPolicy(RetryConfig(backoff=0.1, backoff_max=0.5), random.Random(1))
    delays = [policy.backoff(retry) for _ in range(200)]
    assert low <= min(delays) and max(delays) < high
    assert len(set(delays)) > 100  # jittered


def test_budget_and_statuses() -> None:
    policy = RetryPolicy(RetryConfig(max_retries=2, retry_on=(503,)))
    assert [policy.allows(n) for n in (1, 2, 3)] == [True, True, False]
    assert policy.retryable_status(503) and not policy.retryable_status(500)


def test_excluding_takes_tried_backends_out_of_the_candidates_only() -> None:
    class B:
        def __init__(self, name: str) -> None:
            self.name, self.weight, self.inflight = name, 1, 0

    members = tuple(B(n) for n in "abc")
    view = FleetView(members, members, frozenset("abc"))
    narrowed = excluding(view, ["a", "c"])
    assert [b.name for b in narrowed.candidates] == ["b"]
    assert narrowed.candidate_names == {"b"} and narrowed.members == members
