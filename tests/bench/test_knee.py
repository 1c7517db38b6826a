"""`kvroute bench --knee`'s ramp and report (bench/harness/knee.py), on made-up step results: the
ramp stops at a row's first failing step, the knee is the last step that passed, the
ratio is to the best peer's knee, and every step replays the same seeded workload."""

import math
from collections.abc import Sequence

import msgspec

from bench.harness import knee
from bench.harness.loadgen import Outcome
from bench.harness.report import Run
from bench.harness.workloads import RequestSpec, WorkloadSpec, generate

WORKLOAD = WorkloadSpec(shape="long-prefix", requests=12, groups=3, prefix_tokens=200, rate=5.0)
SETTINGS = knee.KneeSettings(start=1.0, factor=1.25, steps=8, slo_ttft=1.0)
UNIT = generate(msgspec.structs.replace(WORKLOAD, rate=1.0))


class FakeFleet:
    """Row r's TTFT is rate / capacity[r] simulated seconds; above failing_above[r] one
    request fails; a row without a capacity cannot run. Records every step."""

    def __init__(self, capacity: dict[str, float], failing_above: dict[str, float]) -> None:
        self.capacity, self.failing_above = capacity, failing_above
        self.calls: list[tuple[str, Sequence[RequestSpec], str]] = []

    async def __call__(self, row: object, specs: Sequence[RequestSpec], label: str) -> Run:
        assert isinstance(row, str)
        self.calls.append((row, specs, label))
        if row not in self.capacity:
            return Run(strategy=row, time_scale=1, wall_seconds=0, outcomes=[], unmeasured="no")
        rate = _rate(specs)
        ttft = rate / self.capacity[row]
        broken = rate > self.failing_above.get(row, math.inf)
        outcomes = [
            Outcome(index=i, group=0, ok=True, sent=i, ttft=ttft, e2e=2 * ttft)
            for i in range(len(specs))
        ]
        if broken:
            outcomes[0].ok, outcomes[0].error = False, "HTTP 503: " + "busy " * 20
        return Run(strategy=row, time_scale=1, wall_seconds=1, outcomes=outcomes)


def _rate(specs: Sequence[RequestSpec]) -> float:
    """The rate a step's workload was generated at: same draws, arrivals / rate."""
    assert specs[-1].arrival and UNIT[-1].arrival
    return UNIT[-1].arrival / specs[-1].arrival


def _ramped(*labels: str, peers: int = 0) -> list[knee.Ramped]:
    n = len(labels)
    return [knee.Ramped(label, i >= n - peers, label) for i, label in enumerate(labels)]


async def test_each_ramp_stops_at_its_first_failing_step_and_its_knee_is_the_last_that_passed():
    fleet = FakeFleet(
        capacity={"KV_AWARE": 3.0, "RANDOM": 10.0, "peer-fast": 2.2, "hopeless": 0.5},
        failing_above={"RANDOM": 1.3},
    )
    rows = _ramped("KV_AWARE", "RANDOM", "hopeless", "peer-fast", "peer-missing", peers=2)
    told: list[str] = []
    found = await knee.find_knees(
        rows,
        WORKLOAD,
        SETTINGS,
        fleet,
        lambda label, step: told.append(knee.step_line(label, step)),
    )
    by_label = {r.label: r for r in found}
    rates = [1.0 * 1.25**i for i in range(SETTINGS.steps)]

    kv = by_label["KV_AWARE"]  # TTFT P90 = rate / 3 passes up to 2.44, fails at 3.05
    assert [s.rate for s in kv.steps] == rates[:6]
    assert [s.passed for s in kv.steps] == [True] * 5 + [False]
    assert kv.knee is kv.steps[4] and kv.bounded
    assert kv.steps[-1].why == f"TTFT P90 {rates[5] / 3 * 1e3:.0f} ms"
    assert kv.knee.summary.e2e_p99 == 2 * kv.knee.summary.ttft_p90

    random_row = by_label["RANDOM"]  # fast, but a request fails above 1.3 req/s
    assert [s.passed for s in random_row.steps] == [True, True, False]
    assert (
        random_row.steps[-1].why
        == f"1 of 12 failed (commonest: {('HTTP 503: ' + 'busy ' * 10)[:60]})"
    )
    assert random_row.knee is random_row.steps[1]

    hopeless = by_label["hopeless"]  # fails its first step: no knee
    assert len(hopeless.steps) == 1 and hopeless.knee is None and hopeless.bounded

    assert by_label["peer-missing"].unmeasured == "no" and not by_label["peer-missing"].steps
    assert knee.reference(found) is by_label["peer-fast"]  # the best peer, not the best row

    calls = [row for row, _, _ in fleet.calls]  # nothing ran past a failing step
    assert calls == ["KV_AWARE"] * 6 + ["RANDOM"] * 3 + ["hopeless"] + ["peer-fast"] * 5 + [
        "peer-missing"
    ]
    assert len(told) == len(calls) - 1  # every step but the unmeasured row's, as it ended
    p90 = f"TTFT P90 {rates[5] / 3 * 1e3:.0f} ms"
    assert told[5] == f"KV_AWARE at {rates[5]:.2f} req/s: {p90}, 0 failed, over: {p90}"
    first = [spec.messages for spec in fleet.calls[0][1]]
    assert all([spec.messages for spec in specs] == first for _, specs, _ in fleet.calls)

    text = "\n".join(knee.lines(found, SETTINGS))
    header = text.splitlines()[0].split()
    assert header[:3] == ["row", "knee", "req/s"] and "vs" in header and "peer" in header
    kv_line = next(line for line in text.splitlines() if line.startswith("KV_AWARE "))
    ratio = kv.knee.rate / by_label["peer-fast"].knee.rate
    assert f"{kv.knee.rate:.2f}" in kv_line.split() and f"{ratio:.2f}x" in kv_line.split()
    hopeless_line = next(line for line in text.splitlines() if line.startswith("hopeless "))
    assert hopeless_line.split()[1] == "<1.00"
    assert "the best peer's (peer-fast)" in " ".join(text.split())


async def test_a_ramp_that_never_fails_is_a_lower_bound_after_its_steps():
    fleet = FakeFleet(capacity={"PREFIX_AWARE": 100.0, "RANDOM": 50.0}, failing_above={})
    settings = SETTINGS._replace(steps=3)
    found = await knee.find_knees(_ramped("PREFIX_AWARE", "RANDOM"), WORKLOAD, settings, fleet)
    assert [len(r.steps) for r in found] == [3, 3]
    assert all(r.knee is r.steps[-1] and not r.bounded for r in found)
    lines = "\n".join(knee.lines(found, settings)).splitlines()
    row = next(line for line in lines if line.startswith("PREFIX_AWARE "))
    assert row.split()[1] == f">={1.25**2:.2f}" and row.endswith("no knee within 3 steps")
    assert "vs best" in lines[0]  # no peer: the ratio is to the best row
