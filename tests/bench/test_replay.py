"""bench.harness.replay: the simulator's engines driven in virtual time by policy objects."""

from __future__ import annotations

import pytest

from bench.harness.replay import main, policy_maker, replay
from bench.harness.workloads import WorkloadSpec, generate
from bench.sim.params import SimParams

LONG = WorkloadSpec(shape="long-prefix", requests=48, groups=8, rate=4.0, seed=3)


def test_the_same_workload_replays_to_the_same_result() -> None:
    first = replay(LONG, policy_maker("KV_AWARE", 3), backends=3)
    second = replay(LONG, policy_maker("KV_AWARE", 3), backends=3)
    assert first.ttft == second.ttft and first.served == second.served
    assert len(first.ttft) == LONG.requests  # every request got its first token


def test_round_robin_spreads_evenly_and_affinity_buys_hits() -> None:
    spread = replay(LONG, policy_maker("ROUND_ROBIN", 3), backends=4)
    assert spread.served == [12, 12, 12, 12]
    pinned = replay(LONG, policy_maker("KV_AWARE", 3), backends=4)
    # 8 documents x 6 questions: pinned, 5 of 6 requests find their document cached
    assert pinned.hit_rate > 0.75 > spread.hit_rate


def test_no_first_token_comes_before_the_prefill_it_needs() -> None:
    """One engine step of the prompt's uncached tokens is the floor of every TTFT."""
    params = SimParams()
    result = replay(LONG, policy_maker("RANDOM", 3), backends=2, params=params)
    floor = params.step_base_ms / 1000
    assert min(result.ttft.values()) >= floor
    cold = params.step_base_ms + 8000 * params.prefill_per_token_ms
    assert max(result.ttft.values()) >= cold / 1000  # a document's first request


def test_a_turn_is_sent_only_after_the_turn_before_it_finished() -> None:
    spec = WorkloadSpec(shape="multi-turn", requests=24, groups=3, rate=50.0, seed=1)
    result = replay(spec, policy_maker("LEAST_OUTSTANDING_REQUESTS", 1), backends=2)
    assert len(result.finished_at) == 24
    requests = generate(spec)
    index = {(r.group, r.turn): r.index for r in requests}
    for r in requests:
        if r.turn:
            assert result.sent_at[r.index] >= result.finished_at[index[(r.group, r.turn - 1)]]
    # at 50 arrivals a second, some turns arrived before the turn before them ended
    assert any(result.sent_at[r.index] > r.arrival for r in requests)


def test_replicas_see_only_their_own_load() -> None:
    one = replay(LONG, policy_maker("KV_AWARE", 3), backends=4)
    two = replay(LONG, policy_maker("KV_AWARE", 3), backends=4, replicas=2)
    assert two.hit_rate < one.hit_rate  # a document one replica placed is cold to the other


def test_the_command_prints_a_row_per_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--requests", "24", "--groups", "4", "--strategies", "kv_aware,round_robin"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[1:3]] == ["KV_AWARE", "ROUND_ROBIN"]
    with pytest.raises(SystemExit):
        main(["--strategies", "FASTEST"])


def test_slow_first_tokens_are_told_apart_by_cause() -> None:
    """Each slow request has one cause: every document's first request is cold; one sent
    while its document's first prefill ran waits on it (own); a cached one queued behind
    another document's prefill is behind."""
    spec = WorkloadSpec(shape="long-prefix", requests=48, groups=8, rate=40.0, seed=3)
    result = replay(spec, policy_maker("KV_AWARE", 3), backends=2)
    every = result.slow_by_cause(0.0)
    assert sum(every.values()) == len(result.ttft) == 48
    assert every["cold"] >= 8 and every["own"] > 0 and every["behind"] > 0, every
    slowest = max(result.ttft.values())
    assert result.slow_by_cause(slowest) == {"cold": 0, "own": 0, "behind": 0}
    cold_floor = result.slow_by_cause(0.5)
    assert cold_floor["cold"] >= 8  # an 8,000-token prefill takes more than 0.5 s


def test_the_command_counts_the_tail_by_cause(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--requests", "24", "--groups", "4", "--strategies", "kv_aware", "--tail", "400"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "over 400 ms: cold / own / behind" in out
    row = next(line for line in out.splitlines() if line.startswith("KV_AWARE"))
    cold = float(row.split()[-5])
    assert cold >= 4  # each of the 4 documents' first requests
