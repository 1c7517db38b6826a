"""The circuit breaker and the health-check hysteresis, as tables of events → states."""

from __future__ import annotations

import pytest

import policies
from router.backends import Fleet
from router.breaker import Breaker, BreakerState
from router.config import BackendConfig, BreakerConfig, HealthConfig
from router.health import HealthChecker

CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
CFG = BreakerConfig(failure_threshold=3, open_seconds=1, half_open_successes=2)


def _play(breaker: Breaker, events: str) -> list[BreakerState]:
    """f/s: a failure/success of an ordinary attempt; T/t: of the half-open trial
    (which first takes the trial slot); c: the trial ends without a verdict;
    h: the open period is over."""
    states = []
    for event in events:
        if event in "Ttc":
            assert breaker.begin(), "the trial slot should be free"
        if event == "h":
            breaker.half_open()
        else:
            ok = {"f": False, "s": True, "T": False, "t": True, "c": None}[event]
            breaker.record(ok, trial=event in "Ttc")
        states.append(breaker.state)
    return states


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        pytest.param("ff", [CLOSED, CLOSED], id="below-threshold"),
        pytest.param("fff", [CLOSED, CLOSED, OPEN], id="opens-at-threshold"),
        pytest.param("ffsff", [CLOSED] * 5, id="a-success-resets-the-count"),
        pytest.param("fffh", [CLOSED, CLOSED, OPEN, HALF], id="half-opens-after-the-period"),
        pytest.param("fffhtt", [CLOSED, CLOSED, OPEN, HALF, HALF, CLOSED], id="trials-close-it"),
        pytest.param("fffhT", [CLOSED, CLOSED, OPEN, HALF, OPEN], id="failed-trial-reopens"),
        pytest.param("fffhtT", [CLOSED, CLOSED, OPEN, HALF, HALF, OPEN], id="success-then-fail"),
        pytest.param("fffhf", [CLOSED, CLOSED, OPEN, HALF, HALF], id="late-failure-ignored"),
        pytest.param("fffs", [CLOSED, CLOSED, OPEN, OPEN], id="late-success-ignored-when-open"),
        pytest.param("fffhctt", [CLOSED, CLOSED, OPEN, HALF, HALF, HALF, CLOSED], id="cancel"),
        pytest.param(
            "fffhttfff", [*[CLOSED] * 2, OPEN, HALF, HALF, *[CLOSED] * 3, OPEN], id="again"
        ),
    ],
)
def test_breaker_moves(events: str, expected: list[BreakerState]) -> None:
    assert _play(Breaker(CFG), events) == expected


def test_half_open_admits_one_trial_at_a_time() -> None:
    breaker = Breaker(CFG)
    _play(breaker, "fffh")
    assert breaker.admits
    assert breaker.begin() is True
    assert not breaker.admits and breaker.begin() is False
    breaker.record(True, trial=True)
    assert breaker.admits  # the next trial may go


def test_disabled_breaker_never_opens() -> None:
    breaker = Breaker(BreakerConfig(enabled=False, failure_threshold=1))
    assert _play(breaker, "ffff") == [CLOSED] * 4


def _fleet(n: int = 2) -> Fleet:
    configs = [BackendConfig(url=f"http://127.0.0.1:{9000 + i}", name=f"b{i}") for i in range(n)]
    return Fleet(configs, policies.create(policies.policy_class("RANDOM").params_type()))


@pytest.mark.parametrize(
    ("checks", "expected"),
    [
        pytest.param("xx", [True, True], id="two-failures-keep-it-up"),
        pytest.param("xxx", [True, True, False], id="three-mark-it-down"),
        pytest.param("xx.xx", [True] * 5, id="a-pass-resets"),
        pytest.param("xxx.", [True, True, False, False], id="one-pass-is-not-enough"),
        pytest.param("xxx..", [True, True, False, False, True], id="two-passes-mark-it-up"),
        pytest.param("xxx.x..", [True, True, False, False, False, False, True], id="flap"),
    ],
)
def test_health_check_hysteresis(checks: str, expected: list[bool]) -> None:
    fleet = _fleet()
    checker = HealthChecker(fleet, None, HealthConfig(unhealthy_threshold=3, healthy_threshold=2))
    backend = fleet.members[0]
    seen = []
    for check in checks:
        checker.judge(backend, check == ".")
        seen.append(backend.healthy)
    assert seen == expected
    assert fleet.members[1].healthy


def test_usable_needs_health_breaker_and_no_drain() -> None:
    fleet = _fleet()
    b0 = fleet.members[0]
    assert [b.name for b in fleet.view("m").candidates] == ["b0", "b1"]
    fleet.set_draining(b0, True)
    assert [b.name for b in fleet.view("m").candidates] == ["b1"]
    fleet.set_draining(b0, False)
    fleet.set_healthy(b0, False)
    assert [b.name for b in fleet.view("m").candidates] == ["b1"]
    assert b0.transitions == {"draining": 1, "undrained": 1, "down": 1}
