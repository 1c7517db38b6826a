"""The circuit breaker and the health-check hysteresis, as tables of events → states."""

from __future__ import annotations

import pytest

import policies
from router.config import BackendConfig, BreakerConfig, HealthConfig
from router.fleet.backends import Fleet
from router.fleet.breaker import Breaker, BreakerState, Outcome, outcome
from router.fleet.health import HealthChecker

CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
CFG = BreakerConfig(failure_threshold=3, open_seconds=1, half_open_successes=2)


_VERDICTS = {
    "f": Outcome.FAILURE,
    "e": Outcome.SERVER_ERROR,
    "s": Outcome.SUCCESS,
    "T": Outcome.FAILURE,
    "E": Outcome.SERVER_ERROR,
    "t": Outcome.SUCCESS,
    "c": None,
}


def _play(breaker: Breaker, events: str) -> list[BreakerState]:
    """f/e/s: a failure/server error (a 500)/success of an ordinary attempt; T/E/t: of
    the half-open trial (which first takes the trial slot); c: the trial ends without a
    verdict; h: the open period is over; r: the owner refuses the opening."""
    states = []
    for event in events:
        if event in "TEtc":
            assert breaker.begin(), "the trial slot should be free"
        if event == "h":
            breaker.half_open()
        elif event == "r":
            breaker.refuse()
        else:
            breaker.record(_VERDICTS[event], trial=event in "TEtc")
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


@pytest.mark.parametrize(
    ("weight", "events", "expected"),
    [
        pytest.param(0.1, "e" * 29, [CLOSED] * 29, id="29-of-weight-0.1-are-below-3"),
        pytest.param(0.1, "e" * 30, [CLOSED] * 29 + [OPEN], id="30-weigh-3-failures"),
        pytest.param(0.5, "ffe", [CLOSED] * 3, id="they-add-to-failures"),
        pytest.param(0.5, "ffee", [CLOSED] * 3 + [OPEN], id="two-of-0.5-weigh-one"),
        pytest.param(0.5, "eeseef", [CLOSED] * 6, id="a-success-resets-them-too"),
        pytest.param(0.0, "e" * 50, [CLOSED] * 50, id="weight-0-never-counts"),
        pytest.param(0.5, "fffhE", [CLOSED, CLOSED, OPEN, HALF, HALF], id="trial-500-not-one"),
        pytest.param(0.5, "fffhEE", [CLOSED, CLOSED, OPEN, HALF, HALF, OPEN], id="trial-500s"),
        pytest.param(0.5, "fffhEtt", [CLOSED, CLOSED, OPEN, HALF, HALF, HALF, CLOSED], id="mix"),
    ],
)
def test_server_errors_weigh_a_share_of_a_failure(
    weight: float, events: str, expected: list[BreakerState]
) -> None:
    cfg = BreakerConfig(failure_threshold=3, half_open_successes=2, server_error_weight=weight)
    assert _play(Breaker(cfg), events) == expected


@pytest.mark.parametrize(
    ("status", "verdict"),
    [
        *((s, Outcome.SUCCESS) for s in (200, 204, 400, 401, 404, 413, 422, 429, 501, 505)),
        *((s, Outcome.FAILURE) for s in (502, 503, 504)),
        *((s, Outcome.SERVER_ERROR) for s in (500, 506, 507, 599)),
    ],
)
def test_what_a_status_counts_for(status: int, verdict: Outcome) -> None:
    """A client can provoke a 4xx (never counted) and a 500 (weighted) from a healthy
    backend, not a 502/503/504; 501 and 505 say what the request asked for."""
    assert outcome(status) is verdict


def test_a_refused_opening_stays_closed_and_counts_again_from_zero() -> None:
    assert _play(Breaker(CFG), "fffrff") == [CLOSED, CLOSED, OPEN, CLOSED, CLOSED, CLOSED]
    assert _play(Breaker(CFG), "fffrfff")[-1] is OPEN


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


def _breakers_fleet(n: int, **breaker) -> Fleet:
    configs = [BackendConfig(url=f"http://127.0.0.1:{9000 + i}", name=f"b{i}") for i in range(n)]
    policy = policies.create(policies.policy_class("RANDOM").params_type())
    return Fleet(configs, policy, BreakerConfig(failure_threshold=1, **breaker))


def _names(fleet: Fleet) -> list[str]:
    return [b.name for b in fleet.view("m").candidates]


@pytest.mark.parametrize(
    ("n", "percent", "opened"),
    [
        pytest.param(4, 50.0, [True, True, False, False], id="half-of-four"),
        pytest.param(3, 50.0, [True, False, False], id="one-of-three"),
        pytest.param(1, 50.0, [False], id="a-lone-backend-stays"),
        pytest.param(3, 100.0, [True, True, True], id="no-cap"),
        pytest.param(3, 0.0, [False, False, False], id="never"),
    ],
)
async def test_the_ejection_cap_refuses_openings_past_it(
    n: int, percent: float, opened: list[bool]
) -> None:
    fleet = _breakers_fleet(n, max_ejection_percent=percent, panic_threshold_percent=0)
    refused = [fleet.attempt_verdict(b, Outcome.FAILURE, False) for b in fleet.members]
    assert [b.breaker.state is OPEN for b in fleet.members] == opened
    assert refused == [not o for o in opened]
    assert _names(fleet) == [b.name for b, o in zip(fleet.members, opened, strict=True) if not o]


async def test_a_half_open_breaker_counts_as_ejected_and_may_open_again() -> None:
    fleet = _breakers_fleet(3, max_ejection_percent=50, panic_threshold_percent=0)
    b0, b1, _ = fleet.members
    fleet.attempt_verdict(b0, Outcome.FAILURE, False)
    fleet._half_open(b0)
    assert fleet.attempt_verdict(b1, Outcome.FAILURE, False)  # b0 is still out
    assert not fleet.attempt_verdict(b0, Outcome.FAILURE, fleet.attempt_begins(b0))
    assert (b0.breaker.state, b1.breaker.state) == (OPEN, CLOSED)  # the trial reopened it


async def test_panic_routes_over_breakers_open_while_checks_pass() -> None:
    fleet = _breakers_fleet(4, max_ejection_percent=100)
    b0, b1, b2, b3 = fleet.members
    fleet.attempt_verdict(b0, Outcome.FAILURE, False)
    fleet.attempt_verdict(b1, Outcome.FAILURE, False)
    assert _names(fleet) == ["b2", "b3"] and not fleet.view("m").panic  # 2 of 4: not below
    fleet.set_healthy(b2, False)  # 1 of 4 usable: panic takes the open ones, not b2
    assert _names(fleet) == ["b0", "b1", "b3"] and fleet.view("m").panic
    fleet.set_draining(b1, True)  # a drained one stays out; 1 of 3 is still below
    assert _names(fleet) == ["b0", "b3"]
    fleet.set_healthy(b3, False)
    fleet.set_healthy(b0, False)  # nothing passes checks: nothing to panic over
    assert _names(fleet) == [] and not fleet.view("m").panic and not fleet.any_usable()


async def test_no_panic_when_its_threshold_is_zero() -> None:
    fleet = _breakers_fleet(2, max_ejection_percent=100, panic_threshold_percent=0)
    for b in fleet.members:
        fleet.attempt_verdict(b, Outcome.FAILURE, False)
    assert _names(fleet) == [] and not fleet.any_usable()
    fleet.breaker_cfg = BreakerConfig(panic_threshold_percent=50)
    fleet.changed()
    assert _names(fleet) == ["b0", "b1"] and fleet.any_usable()


def test_a_refused_connection_marks_down_at_once_and_checks_bring_it_back() -> None:
    fleet = _fleet()
    checker = HealthChecker(fleet, None, HealthConfig(unhealthy_threshold=3, healthy_threshold=2))
    b0 = fleet.members[0]
    assert checker.refused(b0)
    assert not b0.healthy and b0.check_streak == -3 and _names(fleet) == ["b1"]
    checker.judge(b0, True)
    assert not b0.healthy  # one pass is not enough, as after three failed checks
    checker.judge(b0, True)
    assert b0.healthy and b0.transitions == {"down": 1, "up": 1}
    off = HealthChecker(fleet, None, HealthConfig(enabled=False))
    assert not off.refused(b0) and b0.healthy  # no checks would bring it back
