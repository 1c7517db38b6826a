"""`kvroute bench --knee`: each row's capacity, the highest Poisson rate it sustains.

Routers differ most near capacity, where one fixed, moderate rate shows little. For each
row (each kvroute strategy, then with --peers each peer router) the rate ramps from
--knee-start by --knee-factor (1.25x): each step replays the same seeded workload at
that rate through the harness's `run_row`, so every step, like every row, starts on a
fresh, cold fleet and router. A step passes when no request failed and TTFT P90 stays
under --slo-ttft (simulated seconds). A row's ramp stops at its first failing step, or
after --knee-steps; its knee is the last step that passed, with that step's TTFT and E2E
percentiles and hit rate. A ramp that never failed gives a lower bound (">="). Each
row's knee is set against the best peer's (the best row's when no peer was measured):
the capacity ratio the field reports (llm-d: input throughput at the knee against round
robin).

The default start, 0.5 requests per simulated second for each backend at speed 1 (the
sum of --speeds over 2), is below every router's capacity on the default workloads, so
the first step passes and the ramp finds the knee within a few steps.

The rates that matter are high, so a step's first seconds weigh: every document is new
then and its first prefills arrive together. With 16 documents and 240 requests that
burst set the failing step's P90 on hot-prefix; with 1,200 it is 2% of the requests and
the knee is the sustained rate's. The harness runs a ramp at time scale 1 unless told:
at 0.5 a 2-core host ran out of CPU below a 4-backend fleet's knee.

Cost: one fleet and router start per step; a step replays --requests requests, so its
wall time is requests / rate x time_scale.
"""

from __future__ import annotations

import argparse
import textwrap
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import msgspec

from bench.harness.report import Run, Summary, counted, fixed_width, summarize
from bench.harness.workloads import RequestSpec, WorkloadSpec, generate

__all__ = [
    "KneeRow",
    "KneeSettings",
    "KneeStep",
    "Ramped",
    "add_knee_options",
    "chart",
    "find_knees",
    "judge",
    "knee_settings",
    "lines",
    "step_line",
]

DEFAULT_FACTOR = 1.25
DEFAULT_STEPS = 12
DEFAULT_SLO_TTFT = 1.0  # simulated seconds
START_PER_BACKEND = 0.5  # requests per simulated second, per backend at speed 1


class KneeSettings(NamedTuple):
    """How each row's rate ramps, and what a step must meet."""

    start: float  # requests per simulated second
    factor: float
    steps: int
    slo_ttft: float  # simulated seconds


class Ramped(NamedTuple):
    """One row to ramp: its label, whether it is a peer router, and the harness's row."""

    label: str
    peer: bool
    row: object


class KneeStep(msgspec.Struct, kw_only=True):
    """One rate of a row's ramp; latencies in simulated seconds."""

    rate: float
    summary: Summary
    passed: bool
    why: str = ""  # why the step failed
    cpu: dict[str, float] = {}  # the run's: process -> share of one core
    loop_lag_p99: float | None = None  # the harness's event loop, seconds


class KneeRow(msgspec.Struct, kw_only=True):
    label: str
    peer: bool
    steps: list[KneeStep]
    unmeasured: str = ""  # why the row could not run (a peer not installed, say)

    @property
    def knee(self) -> KneeStep | None:
        """The highest step that passed; None if the first one failed."""
        return next((s for s in reversed(self.steps) if s.passed), None)

    @property
    def bounded(self) -> bool:
        """Whether a step failed: else the knee is only a lower bound."""
        return bool(self.steps) and not self.steps[-1].passed


#: run one step: the row's router on a fresh fleet, the requests, a progress label
RunStep = Callable[[object, Sequence[RequestSpec], str], Awaitable[Run]]


def add_knee_options(group: argparse._ArgumentGroup) -> None:
    """--knee and its knobs; `knee_settings` reads them back."""
    group.add_argument(
        "--knee",
        action="store_true",
        help="find each row's capacity: ramp the Poisson rate from --knee-start by "
        "--knee-factor, every step the same seeded workload on a fresh fleet, until TTFT "
        "P90 exceeds --slo-ttft or a request fails; report the highest rate that held, its "
        "TTFT and E2E P50/P90/P99 and hit rate, and each row's ratio to the best peer's "
        "(to the best row's without peers)",
    )
    group.add_argument(
        "--knee-start",
        type=_positive,
        metavar="RATE",
        help=f"first rate, req/s simulated (default: {START_PER_BACKEND:g} per backend at "
        "speed 1, i.e. the sum of --speeds / 2)",
    )
    group.add_argument(
        "--knee-factor",
        type=_above_one,
        metavar="X",
        help=f"each step's rate over the last's (default: {DEFAULT_FACTOR:g})",
    )
    group.add_argument(
        "--knee-steps",
        type=int,
        metavar="N",
        help=f"at most this many steps per row (default: {DEFAULT_STEPS})",
    )
    group.add_argument(
        "--slo-ttft",
        type=_positive,
        metavar="SECONDS",
        help=f"a step passes while TTFT P90 is under this, simulated (default: "
        f"{DEFAULT_SLO_TTFT:g})",
    )


def knee_settings(args: argparse.Namespace, fleet_speed: float) -> KneeSettings | None:
    """The ramp --knee asks for (None without it); `fleet_speed` is the sum of the
    backends' speeds. ValueError names a flag that does not fit."""
    knobs = {
        "--knee-start": args.knee_start,
        "--knee-factor": args.knee_factor,
        "--knee-steps": args.knee_steps,
        "--slo-ttft": args.slo_ttft,
    }
    if not args.knee:
        given = [flag for flag, value in knobs.items() if value is not None]
        if given:
            raise ValueError(f"{given[0]} goes with --knee")
        return None
    conflicts = {
        "--target": "--knee starts a fleet for every step; it does not go with --target",
        "--concurrency": "--knee ramps Poisson arrivals; it does not go with --concurrency",
        "--rate": "--knee ramps the rate from --knee-start; it does not go with --rate",
        "--seeds": "--knee runs one seed (--seed)",
    }
    for flag, why in conflicts.items():
        if getattr(args, flag[2:]) is not None:
            raise ValueError(why)
    if args.knee_steps is not None and args.knee_steps < 1:
        raise ValueError(f"--knee-steps must be 1 or more, got {args.knee_steps}")
    return KneeSettings(
        start=args.knee_start or START_PER_BACKEND * fleet_speed,
        factor=args.knee_factor or DEFAULT_FACTOR,
        steps=args.knee_steps or DEFAULT_STEPS,
        slo_ttft=args.slo_ttft or DEFAULT_SLO_TTFT,
    )


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _above_one(text: str) -> float:
    value = float(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 1, got {text}")
    return value


#: told each step as it ends (a ramp takes minutes): the row's label and the step
OnStep = Callable[[str, KneeStep], None]


async def find_knees(
    rows: Sequence[Ramped],
    workload: WorkloadSpec,
    settings: KneeSettings,
    run_step: RunStep,
    on_step: OnStep | None = None,
) -> list[KneeRow]:
    """Each row's ramp, in order."""
    return [await _ramp(row, workload, settings, run_step, on_step) for row in rows]


async def _ramp(
    row: Ramped,
    workload: WorkloadSpec,
    settings: KneeSettings,
    run_step: RunStep,
    on_step: OnStep | None,
) -> KneeRow:
    steps: list[KneeStep] = []
    rate = settings.start
    for _ in range(settings.steps):
        specs = generate(msgspec.structs.replace(workload, rate=rate))
        run = await run_step(row.row, specs, f"{row.label} @{rate:.3g}/s")
        if run.unmeasured:
            return KneeRow(label=row.label, peer=row.peer, steps=steps, unmeasured=run.unmeasured)
        steps.append(judge(run, rate, settings.slo_ttft))
        if on_step is not None:
            on_step(row.label, steps[-1])
        if not steps[-1].passed:
            break
        rate *= settings.factor
    return KneeRow(label=row.label, peer=row.peer, steps=steps)


def judge(run: Run, rate: float, slo_ttft: float) -> KneeStep:
    """A step passes when every request succeeded and TTFT P90 is under `slo_ttft`."""
    summary = summarize(run)
    why = ""
    if summary.failed or not summary.ok:
        why = f"{summary.failed} of {summary.ok + summary.failed} failed{_commonest(run)}"
    elif summary.ttft_p90 is None or summary.ttft_p90 >= slo_ttft:
        p90 = "n/a" if summary.ttft_p90 is None else f"{summary.ttft_p90 * 1e3:.0f} ms"
        why = f"TTFT P90 {p90}"
    return KneeStep(
        rate=rate,
        summary=summary,
        passed=not why,
        why=why,
        cpu=run.cpu,
        loop_lag_p99=run.loop_lag_p99,
    )


def _commonest(run: Run) -> str:
    """The failed requests' commonest error, to say why a step failed."""
    errors = Counter((o.error or "?")[:60] for o in run.outcomes if not o.ok)
    return f" (commonest: {errors.most_common(1)[0][0]})" if errors else ""


def reference(rows: Sequence[KneeRow]) -> KneeRow | None:
    """The best peer with a knee, else the best row with one: what the ratio is to."""
    with_knee = [r for r in rows if r.knee is not None]
    pool = [r for r in with_knee if r.peer] or with_knee
    return max(pool, key=lambda r: r.knee.rate if r.knee else 0.0, default=None)


class _Line(msgspec.Struct, kw_only=True):
    """One row of the knee table."""

    row: str
    knee: str
    steps: str
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    ttft_p99: float | None = None
    e2e_p50: float | None = None
    e2e_p90: float | None = None
    e2e_p99: float | None = None
    hit_rate: float | None = None
    ratio: float | None = None
    stopped: str = ""


_COLUMNS = (
    ("row", "row", "text"),
    ("knee req/s", "knee", "{}"),
    ("steps", "steps", "{}"),
    ("TTFT p50", "ttft_p50", "ms"),
    ("p90", "ttft_p90", "ms"),
    ("p99", "ttft_p99", "ms"),
    ("E2E p50", "e2e_p50", "ms"),
    ("p90", "e2e_p90", "ms"),
    ("p99", "e2e_p99", "ms"),
    ("KV hit", "hit_rate", "pct"),
    ("vs best", "ratio", "{:.2f}x"),  # "vs peer" when the reference is a peer
    ("stopped by", "stopped", "text"),
)


def _line(row: KneeRow, best: KneeRow | None, settings: KneeSettings) -> _Line:
    steps = f"{sum(s.passed for s in row.steps)}/{len(row.steps)}"
    if row.unmeasured:
        return _Line(row=row.label, knee="n/a", steps=steps, stopped=row.unmeasured)
    last = row.steps[-1]
    stopped = (
        f"{last.why} at {last.rate:.2f}"
        if row.bounded
        else f"no knee within {counted(settings.steps, 'step')}"
    )
    knee = row.knee
    if knee is None:
        return _Line(row=row.label, knee=f"<{settings.start:.2f}", steps=steps, stopped=stopped)
    s = knee.summary
    ratio = knee.rate / best.knee.rate if best is not None and best.knee is not None else None
    return _Line(
        row=row.label,
        knee=f"{'' if row.bounded else '>='}{knee.rate:.2f}",
        steps=steps,
        ttft_p50=s.ttft_p50,
        ttft_p90=s.ttft_p90,
        ttft_p99=s.ttft_p99,
        e2e_p50=s.e2e_p50,
        e2e_p90=s.e2e_p90,
        e2e_p99=s.e2e_p99,
        hit_rate=s.hit_rate,
        ratio=ratio,
        stopped=stopped,
    )


def lines(rows: Sequence[KneeRow], settings: KneeSettings) -> list[str]:
    """The knee table, what it means, and every row's steps."""
    best = reference(rows)
    peer = best is not None and best.peer
    columns = [
        ("vs peer", f, fmt) if f == "ratio" and peer else (h, f, fmt) for h, f, fmt in _COLUMNS
    ]
    versus = "the best peer's" if peer else "the best row's"
    legend = (
        f"knee: the highest rate (requests per simulated second) at which TTFT P90 stayed "
        f"under {settings.slo_ttft * 1e3:.0f} ms and no request failed, ramping from "
        f"{settings.start:.2f} by {settings.factor:g}x (>=: no step failed, a lower bound); "
        f"its latencies (ms, simulated) and fleet KV hit rate; vs: the knee over "
        f"{versus}" + (f" ({best.label})." if best is not None else ".")
    )
    out = [
        fixed_width([_line(r, best, settings) for r in rows], columns),
        textwrap.fill(legend, 92),
        "Steps (req/s: TTFT P90 ms, + passed, x failed):",
    ]
    for row in rows:
        cells = [
            f"{s.rate:.2f}: {_ms(s.summary.ttft_p90)} {'+' if s.passed else 'x'}" for s in row.steps
        ]
        out.append(f"  {row.label}: {', '.join(cells) or row.unmeasured}")
    return out


def step_line(label: str, step: KneeStep) -> str:
    """One finished step in words, for a progress log."""
    verdict = "held" if step.passed else f"over: {step.why}"
    return (
        f"{label} at {step.rate:.2f} req/s: TTFT P90 {_ms(step.summary.ttft_p90)} ms, "
        f"{step.summary.failed} failed, {verdict}"
    )


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.0f}"


def chart(rows: Sequence[KneeRow], settings: KneeSettings, path: Path) -> bool:
    """Rate against TTFT P90, one line per row, the SLO, each knee and each failed step
    marked, as a PNG; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, row in enumerate(r for r in rows if r.steps):
        points = [(s.rate, s.summary.ttft_p90) for s in row.steps if s.summary.ttft_p90]
        ax.plot(*zip(*points, strict=True), marker="o", color=f"C{i}", label=row.label)
        if row.knee is not None and row.knee.summary.ttft_p90:
            ax.plot(row.knee.rate, row.knee.summary.ttft_p90, "*", ms=14, color=f"C{i}")
        for s in row.steps:
            if not s.passed and s.summary.ttft_p90:  # over the SLO, or requests failed
                ax.plot(s.rate, s.summary.ttft_p90, "x", ms=10, mew=2, color=f"C{i}")
    ax.axhline(settings.slo_ttft, color="grey", linestyle="--", label="SLO (TTFT P90)")
    ax.set(xscale="log", yscale="log", xlabel="Poisson rate, requests per simulated second")
    ax.set(ylabel="TTFT P90, simulated seconds", title="capacity: each row's knee (*), failed (x)")
    plain = matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(plain)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
