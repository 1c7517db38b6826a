"""Turn raw benchmark runs into numbers: one summary per strategy, a table, a reading, a chart.

A `Run` is what the harness measured for one strategy: the per-request `Outcome`s, each
backend's counter deltas over the replay (requests, busy seconds, prefix-cache hits and
queries), the router's decision-time histogram delta and the calibrated hop cost.
`summarize` reduces it to a `Summary`:

- TTFT, ITL and end-to-end percentiles over successful requests (linear interpolation
  between order statistics), and throughput (successful requests per second between the
  first send and the last completion). These are divided by `time_scale`, so they read in
  simulated time, comparable across time scales and with real hardware; the router's own
  costs (decision time, hop) are real time and are never scaled.
- Fleet KV hit rate: sum of prefix-cache hit deltas / sum of query deltas over backends
  (vLLM's `vllm:prefix_cache_{hits,queries}_total`: tokens), else the clients'
  `cached_tokens / prompt_tokens` when the target reported them, else n/a.
- Tier hit rate, with KV offloading: the prompt tokens loaded from an offload tier
  (`vllm:external_prefix_cache_hits_total`) over the same queries; its column shows only
  when some row has one.
- Load spread: max / mean over backends of requests and of busy time (1.0 = even).

A row that could not be measured (a peer router that is not installed or did not start)
is a Run with no outcomes and `unmeasured` saying why: every cell n/a, the reason in the
note column. With several seeds, `seed_means` averages each row over them.

Cost: O(requests log requests) for the sorts; the chart needs matplotlib (optional).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from bench.harness.learned import LearnedSpeed
from bench.harness.loadgen import Outcome
from router.log import counted

__all__ = [
    "BackendDelta",
    "Run",
    "SeedMean",
    "Setup",
    "Summary",
    "bucket_quantile",
    "chart",
    "counted",
    "fixed_width",
    "legend",
    "means_table",
    "percentile",
    "reading",
    "seed_means",
    "summarize",
    "table",
]


class BackendDelta(msgspec.Struct, kw_only=True):
    """One backend's counters over the replay; None where the backend does not expose them."""

    name: str
    requests: float | None = None
    busy_seconds: float | None = None
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    tier_hits: float | None = None  # loaded from an offload tier (vLLM's external hits)


class Setup(msgspec.Struct, frozen=True, kw_only=True):
    """Which router one row measured, in how many processes, with which parameters."""

    router: str  # "kvroute serve" or a peer's PyPI package
    policy: str  # kvroute's strategy or the peer's --policy
    params: dict[str, object] | None = None  # kvroute's routing section; None: the peer's own
    version: str | None = None  # a peer's
    workers: int = 1  # serving processes per replica
    workers_config: int | None = None  # kvroute's `workers` (0: one per usable core)
    processes: int | None = None  # every process of one replica, counted once it started
    replicas: int = 1
    kv_events: bool = False
    cluster: bool = False  # kvroute's replicas share through Redis (config `cluster`)
    redis_outage: tuple[float, float] | None = None  # Redis down (after, for) seconds
    pools: str | None = None  # kvroute's prefill and decode pools (--pd), in words
    settings: dict[str, object] | None = None  # kvroute's other config sections (--set)


class Run(msgspec.Struct, kw_only=True):
    strategy: str  # the row's label: a kvroute strategy, or a peer router and its policy
    time_scale: float
    wall_seconds: float
    outcomes: list[Outcome]
    backends: list[BackendDelta] = []
    decision_seconds_sum: float | None = None  # router histogram deltas
    decision_buckets: list[tuple[str, float]] = []  # ("le" label, cumulative count)
    hop_seconds: float | None = None  # calibration: median of routed - direct pairs
    loop_lag_p99: float | None = None  # the harness's event loop, seconds
    cpu: dict[str, float] = {}  # process -> share of one core over the replay
    seed: int | None = None  # the workload's
    setup: Setup | None = None  # None: a --target, started elsewhere
    replica_requests: list[float | None] = []  # each router replica's own request count
    unmeasured: str = ""  # why the row has no outcomes (then every figure is n/a)
    speeds: list[LearnedSpeed] = []  # a kvroute row's learned speeds at the end (simulated)


class Summary(msgspec.Struct, kw_only=True):
    """One table row; latencies and throughput in simulated time, router costs real."""

    strategy: str
    seed: int | None
    ok: int
    failed: int
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    e2e_p50: float | None
    e2e_p90: float | None
    e2e_p99: float | None
    throughput: float | None
    hit_rate: float | None
    hit_rate_source: str
    tier_hit_rate: float | None
    spread_requests: float | None
    spread_busy: float | None
    decision_us: float | None  # P50 from the histogram's buckets
    decision_mean_us: float | None
    hop_ms: float | None
    unmeasured: str = ""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def bucket_quantile(buckets: Sequence[tuple[str, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile over ("le", cumulative count) pairs: linear within
    the bucket that holds rank q x total; the last finite bound if that is "+Inf"."""
    total = _count(buckets)
    if not total:
        return None
    rank, low, below = q * total, 0.0, 0.0
    for label, cumulative in buckets:
        le = float(label)
        if cumulative >= rank:
            if math.isinf(le):
                return low
            inside = cumulative - below
            return low + (le - low) * ((rank - below) / inside if inside else 0.0)
        low, below = le, cumulative
    return low


def _count(buckets: Sequence[tuple[str, float]]) -> float | None:
    return buckets[-1][1] if buckets else None


def _micros(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


def summarize(run: Run) -> Summary:
    ok = [o for o in run.outcomes if o.ok]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    itl = [gap for o in ok for gap in o.itl]
    e2e = [o.e2e for o in ok if o.e2e is not None]
    hit_rate, source = _hit_rate(run)
    return Summary(
        strategy=run.strategy,
        seed=run.seed,
        ok=len(ok),
        failed=len(run.outcomes) - len(ok),
        ttft_p50=_scaled(percentile(ttft, 0.5), run),
        ttft_p90=_scaled(percentile(ttft, 0.9), run),
        ttft_p99=_scaled(percentile(ttft, 0.99), run),
        itl_p50=_scaled(percentile(itl, 0.5), run),
        itl_p99=_scaled(percentile(itl, 0.99), run),
        e2e_p50=_scaled(percentile(e2e, 0.5), run),
        e2e_p90=_scaled(percentile(e2e, 0.9), run),
        e2e_p99=_scaled(percentile(e2e, 0.99), run),
        throughput=_throughput(ok, run.time_scale),
        hit_rate=hit_rate,
        hit_rate_source=source,
        tier_hit_rate=_tier_hit_rate(run),
        spread_requests=_spread(b.requests for b in run.backends),
        spread_busy=_spread(b.busy_seconds for b in run.backends),
        decision_us=_micros(bucket_quantile(run.decision_buckets, 0.5)),
        decision_mean_us=_micros(_ratio(run.decision_seconds_sum, _count(run.decision_buckets))),
        hop_ms=None if run.hop_seconds is None else run.hop_seconds * 1e3,
        unmeasured=run.unmeasured,
    )


def _scaled(seconds: float | None, run: Run) -> float | None:
    return None if seconds is None else seconds / run.time_scale


def _throughput(ok: list[Outcome], time_scale: float) -> float | None:
    spans = [(o.sent, o.sent + o.e2e) for o in ok if o.sent is not None and o.e2e is not None]
    if len(spans) < 2:
        return None
    elapsed = max(end for _, end in spans) - min(start for start, _ in spans)
    return len(spans) / (elapsed / time_scale) if elapsed > 0 else None


def _hit_rate(run: Run) -> tuple[float | None, str]:
    hits = [b.prefix_hits for b in run.backends]
    queries = [b.prefix_queries for b in run.backends]
    if hits and None not in hits and None not in queries:
        return _ratio(sum(hits), sum(queries)), "backends' vllm:prefix_cache_* counters"
    usage = [o for o in run.outcomes if o.ok and o.cached_tokens is not None and o.prompt_tokens]
    if usage:
        cached = sum(o.cached_tokens or 0 for o in usage)
        return _ratio(cached, sum(o.prompt_tokens or 0 for o in usage)), "usage.cached_tokens"
    return None, "n/a"


def _tier_hit_rate(run: Run) -> float | None:
    hits = [b.tier_hits for b in run.backends]
    if not hits or None in hits or not any(hits):
        return None
    return _ratio(sum(hits), sum(b.prefix_queries or 0.0 for b in run.backends))


def _spread(values: Iterable[float | None]) -> float | None:
    """max / mean; None if any backend's value is unknown or all are zero."""
    values = list(values)
    if not values or None in values:
        return None
    return _ratio(max(values), sum(values) / len(values))


def _ratio(num: float | None, den: float | None, unit: float = 1.0) -> float | None:
    return None if num is None or not den else num / den * unit


# (header, Summary field, format); a missing value prints as n/a
_COLUMNS = (
    ("strategy", "strategy", "text"),
    ("ok", "ok", "{}"),
    ("fail", "failed", "{}"),
    ("TTFT p50", "ttft_p50", "ms"),
    ("p90", "ttft_p90", "ms"),
    ("p99", "ttft_p99", "ms"),
    ("ITL p50", "itl_p50", "ms1"),
    ("p99", "itl_p99", "ms1"),
    ("E2E p50", "e2e_p50", "ms"),
    ("p90", "e2e_p90", "ms"),
    ("p99", "e2e_p99", "ms"),
    ("req/s", "throughput", "{:.2f}"),
    ("KV hit", "hit_rate", "pct"),
    ("tier hit", "tier_hit_rate", "pct"),
    ("spread req", "spread_requests", "{:.2f}"),
    ("spread busy", "spread_busy", "{:.2f}"),
    ("decide µs", "decision_us", "{:.1f}"),
    ("hop ms", "hop_ms", "{:.2f}"),
    ("note", "unmeasured", "text"),
)
_MEAN_COLUMNS = (
    ("strategy", "strategy", "text"),
    ("seeds", "seeds", "{}"),
    ("TTFT p50", "ttft_p50", "ms"),
    ("p90", "ttft_p90", "ms"),
    ("p99", "ttft_p99", "ms"),
    ("E2E p50", "e2e_p50", "ms"),
    ("p90", "e2e_p90", "ms"),
    ("p99", "e2e_p99", "ms"),
    ("KV hit", "hit_rate", "pct"),
    ("tier hit", "tier_hit_rate", "pct"),
)


def _cell(value: object, fmt: str) -> str:
    if fmt == "text":
        return str(value)
    if value is None:
        return "n/a"
    if fmt == "ms":
        return f"{value * 1e3:.0f}"
    if fmt == "ms1":
        return f"{value * 1e3:.1f}"
    if fmt == "pct":
        return f"{value:.1%}"
    return fmt.format(value)


def legend(summaries: Sequence[Summary], clock: str) -> str:
    """What the columns of `table(summaries)` mean, printed under it; the latencies and
    req/s are in `clock` (simulated time, or a target's wall time)."""
    tiers = (
        "tier hit (with KV offloading, or --pd): the prompt tokens loaded from an offload "
        "tier or transferred from a prefill backend (vLLM's external prefix cache counters); "
    )
    return (
        f"TTFT, ITL (inter-token) and E2E: percentiles in ms of {clock}; req/s: successful "
        "requests per second; KV hit: the fleet's prefix-cache hit rate (prompt tokens); "
        f"{tiers if _has_tiers(summaries) else ''}"
        "spread req / spread busy: the busiest backend's requests / busy time over the mean "
        "(1.00 is even); decide µs: the router's routing decision, P50 (real time); hop ms: "
        "what one pass through the router adds (/tokenize pairs, real time)."
    )


def table(summaries: Sequence[Summary]) -> str:
    """A fixed-width text table, one row per strategy."""
    return fixed_width(summaries, _present(summaries, _COLUMNS))


def _present(
    items: Sequence[object], columns: Sequence[tuple[str, str, str]]
) -> list[tuple[str, str, str]]:
    """The columns, less the tier hit rate when no row has one (no offloading)."""
    tiers = _has_tiers(items)
    return [c for c in columns if tiers or c[1] != "tier_hit_rate"]


def _has_tiers(items: Sequence[object]) -> bool:
    return any(getattr(s, "tier_hit_rate", None) for s in items)


def fixed_width(items: Sequence[object], columns: Sequence[tuple[str, str, str]]) -> str:
    """Text columns to the left, numbers to the right."""
    rows = [[h for h, _, _ in columns]]
    rows += [[_cell(getattr(s, f), fmt) for _, f, fmt in columns] for s in items]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = [
        "  ".join(
            c.ljust(w) if fmt == "text" else c.rjust(w)
            for c, w, (_, _, fmt) in zip(r, widths, columns, strict=True)
        ).rstrip()
        for r in rows
    ]
    return "\n".join(lines)


class SeedMean(msgspec.Struct, kw_only=True):
    """One row's mean over the seeds; None where a seed has no value (n/a stays n/a)."""

    strategy: str
    seeds: int
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    e2e_p50: float | None
    e2e_p90: float | None
    e2e_p99: float | None
    hit_rate: float | None
    tier_hit_rate: float | None


def seed_means(summaries: Sequence[Summary]) -> list[SeedMean]:
    """Each row (by label, in first-seen order) averaged over its seeds' summaries."""
    rows: dict[str, list[Summary]] = {}
    for s in summaries:
        rows.setdefault(s.strategy, []).append(s)
    return [
        SeedMean(
            strategy=label,
            seeds=len(group),
            ttft_p50=_mean(s.ttft_p50 for s in group),
            ttft_p90=_mean(s.ttft_p90 for s in group),
            ttft_p99=_mean(s.ttft_p99 for s in group),
            e2e_p50=_mean(s.e2e_p50 for s in group),
            e2e_p90=_mean(s.e2e_p90 for s in group),
            e2e_p99=_mean(s.e2e_p99 for s in group),
            hit_rate=_mean(s.hit_rate for s in group),
            tier_hit_rate=_mean(s.tier_hit_rate for s in group),
        )
        for label, group in rows.items()
    ]


def _mean(values: Iterable[float | None]) -> float | None:
    values = list(values)
    return None if None in values else sum(values) / len(values)


def means_table(means: Sequence[SeedMean]) -> str:
    return fixed_width(means, _present(means, _MEAN_COLUMNS))


def reading(summaries: Sequence[Summary]) -> list[str]:
    """Plain-language lines: each measured row against the first one (the baseline)."""
    measured = [s for s in summaries if not s.unmeasured]
    if len(measured) < 2:
        return []
    base = measured[0]
    return [_versus(s, base) for s in measured[1:]]


def _versus(s: Summary, base: Summary) -> str:
    parts = [
        f"P50 TTFT {_change(s.ttft_p50, base.ttft_p50)}",
        f"P90 TTFT {_change(s.ttft_p90, base.ttft_p90)}",
        f"KV hit rate {_cell(base.hit_rate, 'pct')} → {_cell(s.hit_rate, 'pct')}",
        f"busy spread {_cell(base.spread_busy, '{:.2f}')} → {_cell(s.spread_busy, '{:.2f}')}",
    ]
    return f"{s.strategy} vs {base.strategy}: " + ", ".join(parts)


def _change(new: float | None, old: float | None) -> str:
    if new is None or not old:
        return "n/a"
    percent = round(100 * (new - old) / old)  # rounded first: no "-0%"
    return f"{percent:+d}%".replace("-", "\N{MINUS SIGN}")


def chart(runs: Sequence[Run], summaries: Sequence[Summary], path: Path) -> bool:
    """TTFT CDFs and hit rate per strategy as a PNG; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    runs = [r for r in runs if not r.unmeasured]
    summaries = [s for s in summaries if not s.unmeasured]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(2, 1))
    for run in runs:
        ttft = sorted(o.ttft / run.time_scale for o in run.outcomes if o.ok and o.ttft)
        if ttft:
            left.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=run.strategy)
    left.set(xscale="log", xlabel="TTFT, simulated seconds", ylabel="fraction of requests")
    left.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    left.set_title("TTFT distribution")
    left.grid(alpha=0.3)
    if left.get_lines():  # every row unmeasured (its simulator died): nothing to name
        left.legend()
    names = [s.strategy for s in summaries]
    rates = [100 * (s.hit_rate or 0.0) for s in summaries]
    bars = right.bar(range(len(names)), rates, color=[f"C{i}" for i in range(len(names))])
    right.bar_label(bars, fmt="%.1f%%", fontsize=8)  # same colours as the TTFT lines
    labels = [n.replace(":", "\n") if ":" in n else n.replace("_", "_\n") for n in names]
    right.set_xticks(range(len(names)), labels, fontsize=7, rotation=30, ha="right")
    right.set(ylim=(0, 100), ylabel="%", title="fleet KV cache hit rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
