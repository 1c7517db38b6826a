"""router/ingress/body_budget.py: a worker's share of the budget, reservations, and the config
rule that keeps one max-size body within it."""

from __future__ import annotations

import pytest

from router.config import ConfigError, build
from router.errors import BodyBudgetFull
from router.ingress.body_budget import BodyBudget, worker_share


@pytest.mark.parametrize(
    ("total", "workers", "max_body", "share"),
    [
        pytest.param(512, 1, 16, 512, id="one-worker-all"),
        pytest.param(512, 4, 16, 128, id="even-split"),
        pytest.param(512, 3, 16, 170, id="rounded-down"),
        pytest.param(512, 64, 16, 16, id="at-least-one-max-body"),
    ],
)
def test_worker_share(total: int, workers: int, max_body: int, share: int) -> None:
    assert worker_share(total, workers, max_body) == share


def test_a_reservation_that_does_not_fit_is_refused_and_changes_nothing() -> None:
    budget = BodyBudget(100)
    budget.take(60)
    budget.take(40)
    with pytest.raises(BodyBudgetFull) as info:
        budget.take(1)
    assert (info.value.status, info.value.retry_after) == (503, 1)
    assert budget.held == 100
    budget.give(40)
    budget.take(40)
    assert budget.held == 100


def test_the_budget_must_hold_one_max_size_body() -> None:
    limits = {"max_body_bytes": 4096, "max_buffered_body_bytes": 2048}
    with pytest.raises(ConfigError, match="max_buffered_body_bytes must be at least"):
        build({"backends": [{"url": "http://b:8000"}], "limits": limits})
