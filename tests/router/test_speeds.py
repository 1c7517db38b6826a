"""Learned backend speeds from synthetic observations: the prior until enough samples,
convergence on two speeds, outliers that cannot swing a figure, every worker reading the
same samples, a backend not learned yet borrowing the other replicas' speed or the
fleet's typical one, the replicas' speeds pooled by samples; and the
answers' median length per model."""

from __future__ import annotations

import random

import pytest

from policies import Speed, create
from policies.kv_aware import KvAwareParams
from policies.round_robin import RoundRobinParams, RoundRobinPolicy
from router.config import BackendConfig, BreakerConfig
from router.fleet.backends import Fleet
from router.fleet.shared_load import LoadTable
from router.fleet.speeds import (
    MIN_ALONE,
    MIN_SAMPLES,
    REFRESH,
    AnswerLengths,
    SpeedLearner,
    pooled,
    typical_speed,
)
from router.ingress.status import speed_source

PRIOR = Speed(10_000.0, 0.025, 0.00015)


def observe(learner: SpeedLearner, true: Speed, n: int, rng: random.Random) -> None:
    """`n` requests on a backend of speed `true`, each timing off by up to 3%."""
    for _ in range(n):
        running = rng.randrange(1, 40)
        gap = true.decode_step_s + true.decode_s_per_request * running
        tokens = rng.randrange(500, 8000)
        wait = tokens / true.prefill_tokens_per_s * rng.uniform(0.97, 1.03)
        joined = gap + true.decode_s_per_request  # the step it ran in, with it
        learner.prefilled(tokens, wait + gap / 2 + joined, running)  # half a step first
        learner.decoded(running, gap * rng.uniform(0.97, 1.03))


def close(learned: Speed, true: Speed, within: float) -> bool:
    return all(abs(a - b) <= within * b for a, b in zip(learned, true, strict=True))


def test_early_prefills_count_at_the_step_learned_since() -> None:
    """Prefills timed before the decode step was known are judged by the step learned
    after them: a fast backend's steps are not taken for the prior's slower ones."""
    learner = SpeedLearner()
    for _ in range(MIN_SAMPLES):
        learner.prefilled(1000, 1000 / 20_000 + 0.005, 0)
    for _ in range(MIN_SAMPLES):
        learner.decoded(1, 0.005)
    assert learner.learned(PRIOR).prefill_tokens_per_s == pytest.approx(20_000)
    assert learner.figures == ("prefill_tokens_per_s", "decode_step_s")  # one batch size


def test_the_prior_holds_until_enough_samples() -> None:
    """Prefills alone need `MIN_SAMPLES`; one stream's decode gives the step at once
    (a slow backend is known by its first stream), at the prior's slope until samples
    at batches far enough apart give one, and then prefills that had nothing queued
    ahead give the rate from `MIN_ALONE`. A span more than `PREFILL_SHARE` other
    prompts' prefills is no sample while there are too few to trim (what is left of its
    gap is the difference of two estimates: 0.018 s read for a 0.025 s step once)."""
    learner = SpeedLearner()
    assert learner.learned(PRIOR) is None
    for _ in range(MIN_SAMPLES - 1):
        learner.prefilled(1000, 0.3, 0)
    learner.prefilled(100, 1.0, 1)  # a short prefill is mostly the step: not a sample
    assert learner.learned(PRIOR) is None
    learner.decoded(3, 0.08, 0.03 * PRIOR.prefill_tokens_per_s)  # 3/8 others' prefills
    assert learner.learned(PRIOR) is None
    learner.decoded(3, 0.05 + 3 * PRIOR.decode_s_per_request)
    learned = learner.learned(PRIOR)
    assert learned.decode_step_s == pytest.approx(0.05)
    assert learned.decode_s_per_request == PRIOR.decode_s_per_request
    assert learned.prefill_tokens_per_s == pytest.approx(1000 / (0.3 - 0.05 - PRIOR[2]))
    assert learner.figures == ("prefill_tokens_per_s", "decode_step_s")


def test_two_speeds_converge_each_on_its_own() -> None:
    rng = random.Random(2)
    fast, slow = Speed(20_000.0, 0.0125, 0.000075), Speed(10_000.0, 0.025, 0.00015)
    learners = {fast: SpeedLearner(), slow: SpeedLearner()}
    for true, learner in learners.items():
        observe(learner, true, 60, rng)
    for true, learner in learners.items():
        assert close(learner.learned(PRIOR), true, 0.15), (learner.learned(PRIOR), true)
        assert learner.figures == Speed._fields


def test_prefills_queued_ahead_and_partly_done_do_not_inflate_the_rate() -> None:
    """A request that came while another's prefill ran waits only for what was left of
    it, but the router counts the whole of it ahead: such samples read fast. With
    a few samples that had nothing ahead, those alone give the rate (before, ~50%
    high here); with none, every sample counts."""
    rng = random.Random(5)
    true = Speed(10_000.0, 0.025, 0.00015)
    learner = SpeedLearner()
    for i in range(2 * MIN_SAMPLES):
        ahead = 0 if i < MIN_ALONE else 8000
        done = rng.uniform(0.3, 0.9) * ahead  # of the prefill ahead, when this came
        own = rng.randrange(1000, 8000)
        wait = (ahead - done + own) / true.prefill_tokens_per_s
        learner.prefilled(ahead + own, wait + true.decode_step_s, 0, ahead)
    learned = learner.learned(PRIOR).prefill_tokens_per_s
    assert learned == pytest.approx(true.prefill_tokens_per_s, rel=0.02)
    crowded = SpeedLearner()
    for _ in range(MIN_SAMPLES):
        crowded.prefilled(16_000, 1.0 + true.decode_step_s, 0, 8000)
    assert crowded.learned(PRIOR).prefill_tokens_per_s == pytest.approx(16_000, rel=0.01)


def test_a_span_that_counted_another_prompt_twice_does_not_move_a_rate_of_few_samples() -> None:
    """Seen on a slow simulated backend: a span that began at the backend's previous
    first token while two prompts were prefilled in chunks together counted both
    prompts' tokens over half their time, a rate twice the true one. Among five samples
    it read the backend 20-30% fast (the tokens-weighted sum of the samples within 3x of
    the median); until `MIN_SAMPLES` the rate is the samples' median."""
    true = Speed(5_000.0, 0.05, 0.0003)
    learner = SpeedLearner()
    step = true.decode_step_s + true.decode_s_per_request  # the step it ran in
    learner.prefilled(16_240, 8_120 / true.prefill_tokens_per_s + step, 0)
    for tokens in (840, 8_120, 8_120, 8_240):
        learner.prefilled(tokens, tokens / true.prefill_tokens_per_s + step, 0)
    learner.decoded(0, true.decode_step_s)  # the step known: the rate is computed at it
    learned = learner.learned(Speed(10_000.0, 0.05, 0.0003)).prefill_tokens_per_s
    assert learned == pytest.approx(true.prefill_tokens_per_s, rel=0.02)


def test_one_outlier_cannot_swing_a_figure() -> None:
    rng = random.Random(3)
    true = Speed(20_000.0, 0.0125, 0.000075)
    learner = SpeedLearner()
    observe(learner, true, 20, rng)
    before = learner.learned(PRIOR)
    learner.prefilled(8000, 80.0, 2)  # a stall: 100 tokens a second
    learner.decoded(2, 5.0)  # a 5 s gap
    after = learner.learned(PRIOR)
    assert close(after, before, 0.05), (before, after)


def test_without_batches_that_differ_the_slope_is_the_priors() -> None:
    learner = SpeedLearner()
    for _ in range(MIN_SAMPLES):
        learner.decoded(10, 0.03)
    learned = learner.learned(PRIOR)
    assert learned.decode_s_per_request == PRIOR.decode_s_per_request
    assert learned.decode_step_s == pytest.approx(0.03 - 10 * PRIOR.decode_s_per_request)
    assert learned.prefill_tokens_per_s == PRIOR.prefill_tokens_per_s
    assert learner.figures == ("decode_step_s",)  # the others are the prior's


def test_every_worker_reads_every_workers_samples(tmp_path) -> None:
    tables = [LoadTable(tmp_path / "load", 8, 2, w) for w in range(2)]
    learners = [SpeedLearner(t, t.slot("b0", "http://a:8000")) for t in tables]
    rng = random.Random(4)
    true = Speed(20_000.0, 0.0125, 0.000075)
    observe(learners[0], true, MIN_SAMPLES // 2, rng)
    observe(learners[1], true, MIN_SAMPLES // 2, rng)
    first, second = (learner.learned(PRIOR) for learner in learners)
    assert first == second and close(first, true, 0.15)
    for t in tables:
        t.close()  # no view of the samples outlives its use


def test_answer_lengths_median_per_model() -> None:
    answers = AnswerLengths()
    assert answers.expected("m") == 0
    for tokens in (10, 1000, 100, 90, 110):
        answers.add("m", tokens)
    assert answers.expected("m") == 100
    assert answers.expected("other") == 0
    for _ in range(AnswerLengths.KEPT):
        answers.add("m", 7)
    assert answers.expected("m") == 7  # only the last answers count


def test_a_learned_speed_is_computed_again_every_few_streams() -> None:
    learner = SpeedLearner()
    observe(learner, Speed(20_000.0, 0.0125, 0.000075), MIN_SAMPLES, random.Random(5))
    speed = learner.refreshed(PRIOR, None)
    assert speed is not None
    stale = Speed(1.0, 1.0, 1.0)
    assert [learner.refreshed(PRIOR, stale) for _ in range(REFRESH - 1)] == [stale] * (REFRESH - 1)
    assert learner.refreshed(PRIOR, stale) == speed


def test_a_backend_not_learned_yet_routes_at_the_fleets_typical_speed() -> None:
    """At the configured speed beside faster learned ones it would get no streams to
    learn from: once tried, it borrows the median of the learned speeds until it has
    its own."""
    backends = [BackendConfig(url=f"http://b{i}:8000", name=f"b{i}") for i in range(4)]
    fleet = Fleet(backends, RoundRobinPolicy(RoundRobinParams()), BreakerConfig())
    learned = [Speed(20_000.0, 0.012, 0.0001), Speed(18_000.0, 0.013, 0.0002), None, None]
    for b, speed in zip(fleet.members, learned, strict=True):
        b.learned_speed = speed
        b.speed_samples.decoded(4, 0.0125)  # tried
    fleet.lend_speeds()
    typical = Speed(19_000.0, 0.0125, 0.00015)
    assert [b.speed for b in fleet.members] == learned[:2] + [pytest.approx(typical)] * 2


def test_an_untried_backend_routes_at_the_fastest_learned_speed_until_a_sample() -> None:
    """Slow backends learned first make the median slow: a fast backend no stream was
    sampled on yet would be judged slow and never tried (a mixed fleet's run left one
    idle throughout). Untried, it borrows the fastest learned figures; once sampled,
    the median until its own speed is learned."""
    backends = [BackendConfig(url=f"http://b{i}:8000", name=f"b{i}") for i in range(4)]
    fleet = Fleet(backends, RoundRobinPolicy(RoundRobinParams()), BreakerConfig())
    fast, slow = Speed(20_000.0, 0.0125, 0.0001), Speed(10_000.0, 0.025, 0.0002)
    learned = [fast, slow, slow, None]
    for b, speed in zip(fleet.members, learned, strict=True):
        b.learned_speed = speed
    fleet.lend_speeds()
    assert fleet.members[3].speed == fast
    fleet.members[3].speed_samples.decoded(4, 0.0125)
    fleet.lend_speeds()
    assert fleet.members[3].speed == slow


def test_a_backend_with_no_speed_of_its_own_is_judged_slowest_while_it_has_requests() -> None:
    """Idle and untried, a backend borrows the fastest figures (the configured speed's
    where faster: it is tried); with a request in flight there, the slowest learned
    ones, so that it takes a second request only where it would at that speed: an
    empty slow backend took every new conversation of a warm-up until its first
    stream's sample."""
    backends = [BackendConfig(url=f"http://b{i}:8000", name=f"b{i}") for i in range(3)]
    fleet = Fleet(backends, create(KvAwareParams()), BreakerConfig())
    slow, slower = Speed(5_000.0, 0.05, 0.0003), Speed(4_000.0, 0.06, 0.0002)
    fleet.members[0].learned_speed, fleet.members[1].learned_speed = slow, slower
    fleet.lend_speeds()
    untried = fleet.members[2]
    assert (untried.speed, speed_source(untried)) == (PRIOR, "fastest")
    untried.count(1, 500)
    assert untried.speed == Speed(4_000.0, 0.06, 0.0003)
    assert speed_source(untried) == "slowest"  # as /debug/routing shows it
    untried.count(-1, -500)
    assert (untried.speed, speed_source(untried)) == (PRIOR, "fastest")
    fleet.members[0].count(1, 500)
    assert fleet.members[0].speed == slow  # its own, in flight or not
    assert speed_source(fleet.members[0]) == "learned"
    untried.speed_samples.prefilled(1_000, 0.2, 0)  # sampled, not learned: the median
    fleet.lend_speeds()
    assert (untried.speed, speed_source(untried)) == (typical_speed([slow, slower]), "typical")


def test_a_speed_another_worker_learned_is_taken_before_the_next_pick(tmp_path) -> None:
    """Every worker reads the same samples, but learns a backend's speed at its own next
    stream there; until then it would route there at a lent speed. A worker that learns
    a backend's first speed says so in the shared table, and the others take it from
    the same samples before their next pick."""
    tables = [LoadTable(tmp_path / "load", 8, 2, w) for w in range(2)]
    backends = [BackendConfig(url=f"http://b{i}:8000", name=f"b{i}") for i in range(2)]
    one, two = (Fleet(backends, create(KvAwareParams()), BreakerConfig(), t) for t in tables)
    two.catch_up()
    assert [b.learned_speed for b in two.members] == [None, None]
    one.members[0].speed_samples.decoded(3, 0.05)
    one.relearn(one.members[0], PRIOR)
    learned = one.members[0].learned_speed
    assert learned is not None and learned.decode_step_s < 0.05
    two.catch_up()
    assert [b.learned_speed for b in two.members] == [learned, None]
    for t in tables:
        t.close()


def test_the_other_replicas_speed_stands_in_until_this_one_learns_its_own() -> None:
    """Own learned first, then the others' (pooled by samples), then the typical one."""
    backends = [BackendConfig(url=f"http://b{i}:8000", name=f"b{i}") for i in range(3)]
    fleet = Fleet(backends, RoundRobinPolicy(RoundRobinParams()), BreakerConfig())
    own, other = Speed(20_000.0, 0.012, 0.0001), Speed(10_000.0, 0.02, 0.0003)
    fleet.members[2].speed_samples.decoded(4, 0.0125)  # tried, not learned
    fleet.members[0].learned_speed = own
    fleet.members[0].shared_speed = fleet.members[1].shared_speed = other
    fleet.lend_speeds()
    assert [b.speed for b in fleet.members] == [
        own,
        other,
        pytest.approx(Speed(15_000.0, 0.016, 0.0002)),
    ]


def test_the_replicas_speeds_pool_weighted_by_their_samples() -> None:
    fast, slow = Speed(30_000.0, 0.01, 0.0), Speed(10_000.0, 0.03, 0.0004)
    assert pooled([(fast, 30), (slow, 10)]) == pytest.approx(Speed(25_000.0, 0.015, 0.0001))
    assert pooled([]) is None


def test_while_no_backend_has_enough_samples_all_of_them_together_stand_in() -> None:
    """Three backends of one kind, far from the prior (an engine on CPUs), three
    one-token answers each (prefill samples, no decode): too few for any one's own
    rate, enough together (the fleet's learner has every stream's samples); every
    backend routes at that until it has its own. Two backends' six are not enough: the
    prior holds."""
    rate = 500.0
    for count, enough in ((3, True), (2, False)):
        backends = [BackendConfig(url=f"http://b{i}:8000", name=f"b{i}") for i in range(count)]
        fleet = Fleet(backends, create(KvAwareParams()), BreakerConfig())
        for b in fleet.members:
            for learner in (b.speed_samples, fleet.speed_samples):
                for _ in range(3):
                    learner.prefilled(1000, 1000 / rate + PRIOR.decode_step_s + PRIOR[2], 0)
            assert b.speed_samples.learned(PRIOR) is None
        for _ in range(REFRESH):
            fleet.learning()
        speeds = [b.speed for b in fleet.members]
        if enough:
            assert all(s.prefill_tokens_per_s == pytest.approx(rate) for s in speeds), speeds
        else:
            assert speeds == [None] * count


def test_first_tokens_are_every_workers_and_settle_once_their_step_is_in(tmp_path) -> None:
    """Where a prefill sample starts: the backend's previous first token, whichever
    worker relayed it, and the tokens prefilled there by a moment after it (None before
    then: a first token in the same step belongs to the sample of the step's first)."""
    tables = [LoadTable(tmp_path / "load", 8, 2, w) for w in range(2)]
    one, two = (SpeedLearner(t, t.slot("b0", "http://a:8000")) for t in tables)
    one.count_prefilled(1000)
    assert one.first_token(10.0)[0] == 0.0  # none before
    two.count_prefilled(500)
    assert two.first_token(10.001) == (10.0, None)  # the same step, not settled yet
    assert one.settle(10.0) == 1500
    assert two.settle(10.001) == 1500
    one.count_prefilled(700)
    assert one.first_token(10.5) == (10.001, 1500)  # the step before, settled
    two.count_prefilled(300)
    assert two.first_token(11.0) == (10.5, None)
    assert one.settle(10.5) == 2500  # every worker's tokens by then
    assert two.first_token(11.5) == (11.0, None)  # never settled: a later one came first
    assert two.settle(11.0) == 2500  # counted, not kept for 11.5
    assert one.first_token(12.0) == (11.5, None)
