"""`kvroute recommend`: which routing strategy and parameters to run, from the traffic.

It reads a router's data capture (or generates a workload, bench/harness/workloads.py), measures
it (bench/harness/traffic.py: shared prefixes, concurrency, prefill rate) and advises, each
choice with its reason:
  - the strategy: LEAST_OUTSTANDING_REQUESTS when under `MIN_REUSE` of the prompt tokens
    repeat an earlier request's prefix past the part nearly all requests share (every
    backend caches that part after its first request anyway); else PREFIX_AWARE when
    several router replicas cannot share state (no KV events); else KV_AWARE;
  - PREFIX_AWARE's `prefix_length`: past the globally shared part, so that requests that
    share only it get different fingerprints, and within what each re-using request
    shares with an earlier one, so that it keeps that request's backend. The default
    (256) when it fits, else the first block past the global part;
  - `concurrency_threshold`: `HEADROOM` x a backend's fair share of the fleet's P99 in
    flight, so only a hot prefix reaches it;
  - KV_AWARE's `prefill_tokens_per_s`: from TTFT against uncached prompt tokens.
The runner-up is the other of PREFIX_AWARE and KV_AWARE (KV_AWARE after
LEAST_OUTSTANDING_REQUESTS). `--validate` runs both on simulated backends with the bench
harness (bench/harness/compare.py), on a workload matched to the traffic: its group count,
shared and question lengths, output length and rate.

Cost: what bench/harness/traffic.py costs, plus the two bench rows with --validate.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import math
import statistics
import sys
import textwrap
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import uvloop

from bench.harness.compare import (
    DEFAULT_BACKENDS,
    DEFAULT_RATE,
    DEFAULT_TIME_SCALE,
    HarnessError,
    Options,
    add_workload_options,
    positive,
    run_bench,
    workload_spec,
)
from bench.harness.report import Summary, counted, percentile, reading, summarize, table
from bench.harness.traffic import (
    NEARLY_ALL,
    Concurrency,
    Prefill,
    Prefixes,
    Tokens,
    Traffic,
    TrafficError,
    concurrency,
    from_workload,
    prefill_rate,
    prefixes,
    read_capture,
)
from bench.harness.workloads import WorkloadSpec, generate
from policies.prefix_aware import PrefixAwareParams

__all__ = [
    "MIN_REUSE",
    "Facts",
    "Setting",
    "advise",
    "build_parser",
    "concurrency_threshold",
    "favoured",
    "main",
    "matched_workload",
    "prefix_length",
]

MIN_REUSE = 0.05
HEADROOM = 2.0
MIN_THRESHOLD = 4
DEFAULT_PREFIX_LENGTH = PrefixAwareParams().prefix_length
DEFAULT_THRESHOLD = PrefixAwareParams().concurrency_threshold
_CUT_OFF = 0.01  # share of re-using requests the default prefix_length may cut short
_WIDTH = 92
_CLEAR_WIN = 0.1
_HOT = 0.5  # one fingerprint pinning this share of the traffic together is worth a word
_EDGES = (1, 256, 1024, 4096, 16384)
LOR, PREFIX, KV = "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE", "KV_AWARE"

_EXAMPLES = """examples:
  # a capture written by the router's data capture (several files, .gz too)
  kvroute recommend capture-*.jsonl.gz
  # three router replicas and no KV events: they cannot share what they learn
  kvroute recommend capture.jsonl --replicas 3
  # a bench workload instead of a capture, and the advice checked on simulated backends
  kvroute recommend --workload multi-turn --requests 200 --groups 20 --validate
  # machine-readable
  kvroute recommend capture.jsonl --json
"""


class Setting(msgspec.Struct, kw_only=True):
    """A strategy, its routing parameters, and why: one reason per choice."""

    strategy: str
    params: dict[str, object]
    why: list[str]

    def yaml(self) -> str:
        fields = [f"strategy: {self.strategy}", *(f"{k}: {v}" for k, v in self.params.items())]
        return "routing: {" + ", ".join(fields) + "}"


class Facts(NamedTuple):
    """What the advice is made from."""

    prefixes: Prefixes
    concurrency: Concurrency | None
    prefill: Prefill
    replicas: int
    kv_events: bool


def advise(facts: Facts) -> list[Setting]:
    """The advice first, then the runner-up."""
    best, why = _strategy(facts)
    order = {LOR: (LOR, KV), PREFIX: (PREFIX, KV), KV: (KV, PREFIX)}[best]
    settings = [_setting(s, facts) for s in order]
    settings[0].why.insert(0, why)
    return settings


def _strategy(facts: Facts) -> tuple[str, str]:
    p = facts.prefixes
    if p.reuse < MIN_REUSE:
        return LOR, (
            f"only {p.reuse:.0%} of the prompt tokens repeat an earlier request's prefix past "
            f"the part nearly all requests share ({p.global_tokens} tokens, which every "
            "backend caches after its first request): affinity has little to gain, so "
            "balance the load"
        )
    repeat = f"{p.reuse:.0%} of the prompt tokens repeat an earlier request's prefix"
    if facts.replicas > 1 and not facts.kv_events:
        return PREFIX, (
            f"{repeat}, and {facts.replicas} router replicas without KV events cannot share "
            "what each learns of the caches: PREFIX_AWARE's consistent hashing makes them "
            "agree with no shared state"
        )
    shared = (
        "its replicas learn the caches from the backends' KV events"
        if facts.replicas > 1
        else "it learns the caches from its own picks, or from KV events when the backends "
        "publish them"
    )
    return KV, (
        f"{repeat}: KV_AWARE sends each request where its longest prefix is cached, "
        f"weighed against each backend's queue; {shared}"
    )


def _setting(strategy: str, facts: Facts) -> Setting:
    params: dict[str, object] = {}
    why: list[str] = []
    if strategy == PREFIX:
        params["prefix_length"], reason = prefix_length(facts.prefixes)
        why.append(reason)
    if strategy == KV:
        rate = facts.prefill.tokens_per_s
        if rate is None:
            why.append(f"prefill_tokens_per_s: the default; {facts.prefill.why}")
        else:
            params["prefill_tokens_per_s"] = _two_digits(rate)
            why.append(f"prefill_tokens_per_s {_two_digits(rate)}: {facts.prefill.why}")
    if strategy in (PREFIX, KV):
        params["concurrency_threshold"], reason = concurrency_threshold(facts.concurrency)
        why.append(reason)
    return Setting(strategy=strategy, params=params, why=why)


def prefix_length(p: Prefixes) -> tuple[int, str]:
    """PREFIX_AWARE's prefix_length for `p`, and why (see the module docstring)."""
    past = p.global_tokens + p.block_size
    reusers = [s for s in p.shared if s > p.global_tokens]
    cut = sum(s < DEFAULT_PREFIX_LENGTH for s in reusers)
    where = (
        f"the globally shared part ({p.global_tokens} tokens, common to {NEARLY_ALL:.0%}+ of "
        "the requests)"
        if p.global_tokens
        else f"any part common to {NEARLY_ALL:.0%}+ of the requests (there is none)"
    )
    if past <= DEFAULT_PREFIX_LENGTH and cut <= _CUT_OFF * len(reusers):
        value = DEFAULT_PREFIX_LENGTH
        reason = (
            f"prefix_length {value} (the default): past {where}, and within what "
            f"{len(reusers) - cut} of the {len(reusers)} re-using requests share with an "
            "earlier one"
        )
    else:
        value = past
        default = (
            "falls inside the global part, so nearly every request would get the same fingerprint"
            if past > DEFAULT_PREFIX_LENGTH
            else f"would cut {cut} of the {len(reusers)} re-using requests short"
        )
        reason = (
            f"prefix_length {value}: the first block past {where}, so requests that share only "
            f"that part are told apart, and every re-using request shares at least that much "
            f"with an earlier one; the default {DEFAULT_PREFIX_LENGTH} {default}"
        )
    if not p.approx:
        reason += (
            ". Counted in ChatML4 tokens: PREFIX_AWARE counts approx tokens of the routing "
            "text, about 5 fewer per message (--tokenizer approx counts them exactly)"
        )
    hot = p.hottest_at(value)
    if hot >= _HOT:
        reason += (
            f". One fingerprint still pins {hot:.0%} of the requests together: bounded load "
            "(load_factor, concurrency_threshold) spreads them"
        )
    return value, reason


def concurrency_threshold(c: Concurrency | None) -> tuple[int, str]:
    if c is None:
        return DEFAULT_THRESHOLD, (
            f"concurrency_threshold {DEFAULT_THRESHOLD} (the default): the traffic has no "
            "timing (at, duration_ms)"
        )
    fair = c.fleet_p99 / c.backends
    value = max(MIN_THRESHOLD, math.ceil(HEADROOM * fair))
    return value, (
        f"concurrency_threshold {value}: {HEADROOM:g} x a backend's fair share of the "
        f"fleet's P99 in flight ({c.fleet_p99:.0f} requests over {c.backends} backends); "
        f"one backend had P99 {c.backend_p99:.0f} and at most {c.backend_max}"
    )


def _two_digits(x: float) -> int:
    return int(round(x, 1 - math.floor(math.log10(x))))


# --- the validation workload ----------------------------------------------------------


def matched_workload(
    p: Prefixes, traffic: Traffic, c: Concurrency | None, requests: int, seed: int
) -> WorkloadSpec:
    """A bench workload shaped like the traffic: unique prompts when nothing is re-used,
    multi-turn behind a shared system prompt when there is a global part, else groups of
    shared documents; its lengths are the traffic's medians."""
    completions = [r.completion_tokens for r in traffic.requests if r.completion_tokens]
    max_tokens = max(1, round(statistics.median(completions))) if completions else 100
    fresh = [n - s for n, s in zip(p.lengths, p.shared, strict=True) if s > p.global_tokens]
    question = round(statistics.median(fresh)) if fresh else 100
    fields: dict[str, object] = {
        "requests": min(requests, p.requests),
        "groups": max(1, len(p.groups)),
        "max_tokens": max_tokens,
        "rate": (c.rate if c and c.rate else DEFAULT_RATE),
        "seed": seed,
    }
    if p.reuse < MIN_REUSE:
        fields.update(shape="no-sharing", prefix_tokens=statistics.median(p.lengths) - 100)
    elif p.global_tokens >= 2 * p.block_size:
        fields.update(shape="multi-turn", prefix_tokens=p.global_tokens)
        question -= max_tokens  # a turn brings the last reply and a new question
    else:
        shared = statistics.median(g.shared_tokens for g in p.groups)
        fields.update(shape="long-prefix", prefix_tokens=shared)
    fields["prefix_tokens"] = max(2, round(fields["prefix_tokens"]))  # type: ignore[arg-type]
    fields["question_tokens"] = max(2, question)
    return msgspec.convert(fields, WorkloadSpec)


def _validate(
    settings: Sequence[Setting], spec: WorkloadSpec, backends: int, args: argparse.Namespace
) -> list[Summary]:
    """Both settings as `kvroute bench` rows, with the replicas and KV events advised for."""
    routing: dict[str, object] = {}
    for s in settings:
        routing.update(s.params)  # a knob two settings have has the same value in both
    options = Options(
        strategies=[s.strategy for s in settings],
        backends=backends,
        time_scale=args.time_scale,
        sim_args=["--kv-events"] if args.kv_events else [],
        routing=routing,
        target=None,
        model=None,
        concurrency=None,
        max_wall=args.max_wall,
        calibration=0,
        seed=spec.seed,
        replicas=args.replicas,
    )
    runs = uvloop.run(run_bench(generate(spec), options))
    return [summarize(r) for r in runs]


def favoured(rows: Sequence[Summary]) -> tuple[str, str]:
    """The validated setting to prefer and why: the advice, unless the runner-up's P90
    TTFT beat it by more than `_CLEAR_WIN` (closer than that is the simulator's noise)."""
    best, runner = rows
    if best.ttft_p90 is None or runner.ttft_p90 is None:
        return best.strategy, "a row has no P90 TTFT (no request succeeded): nothing to compare"
    figures = (
        f"P90 TTFT {1000 * best.ttft_p90:.0f} ms for {best.strategy}, "
        f"{1000 * runner.ttft_p90:.0f} ms for {runner.strategy}"
    )
    if runner.ttft_p90 < (1 - _CLEAR_WIN) * best.ttft_p90:
        return runner.strategy, (
            f"the runner-up did better on this workload ({figures}): prefer it for this "
            "traffic, or check again with more --requests"
        )
    return best.strategy, f"the advice holds on this workload ({figures})"


# --- output -----------------------------------------------------------------------------


def _distribution(values: Sequence[int]) -> dict[str, float]:
    quantiles = {f"p{round(q * 100)}": percentile(list(values), q) for q in (0.1, 0.5, 0.9)}
    return {**quantiles, "max": max(values)}  # type: ignore[dict-item]


def _histogram(values: Sequence[int]) -> dict[str, int]:
    """Requests by shared tokens: 0, then the ranges between `_EDGES`."""
    labels = ["0", *(f"{lo}-{hi - 1}" for lo, hi in itertools.pairwise(_EDGES)), f"{_EDGES[-1]}+"]
    counts = Counter(bisect.bisect_right(_EDGES, v) for v in values)
    return {label: counts[i] for i, label in enumerate(labels)}


def _prefix_doc(p: Prefixes) -> dict[str, object]:
    sizes = [g.requests for g in p.groups]
    parts = [g.shared_tokens for g in p.groups]
    return {
        "tokens": p.tokens,
        "block_size": p.block_size,
        "requests": p.requests,
        "prompt_tokens": p.prompt_tokens,
        "global_tokens": p.global_tokens,
        "groups": len(p.groups),
        "group_requests": _distribution(sizes) if sizes else None,
        "group_shared_tokens": _distribution(parts) if parts else None,
        "shared_tokens": _distribution(p.shared),
        "shared_histogram": _histogram(p.shared),
        "reuse": p.reuse,
        "reuse_all": p.reuse_all,
    }


class _Report(NamedTuple):
    traffic: Traffic
    facts: Facts
    settings: list[Setting]
    workload: WorkloadSpec | None
    validation: list[Summary] | None


def _print_json(r: _Report) -> None:
    doc = {
        "source": r.traffic.source,
        "requests": len(r.traffic.requests),
        "skipped": r.traffic.skipped,
        "prefixes": _prefix_doc(r.facts.prefixes),
        "concurrency": r.facts.concurrency,
        "prefill": r.facts.prefill,
        "advice": r.settings,
        "validation": None
        if r.validation is None
        else {
            "workload": r.workload,
            "rows": r.validation,
            "favoured": favoured(r.validation)[0],
        },
    }
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(doc)).decode() + "\n")


def _print_text(r: _Report) -> None:
    t, p = r.traffic, r.facts.prefixes
    skipped = "; ".join(f"{n} {why}" for why, n in t.skipped.items())
    print(
        f"{t.source}: {counted(len(t.requests), 'request')}"
        + (f" ({skipped}, left out)" if skipped else "")
    )
    for line in [*_prefix_lines(p), *_load_lines(r.facts)]:
        indent = " " * (len(line) - len(line.lstrip()) + 2)
        print(textwrap.fill(line, _WIDTH, subsequent_indent=indent))
    for label, s in zip(("Advice", "Runner-up"), r.settings, strict=True):
        print(f"\n{label}: {s.strategy}\n  {s.yaml()}")
        for reason in s.why:
            print(textwrap.fill(reason, _WIDTH, initial_indent="  - ", subsequent_indent="    "))
    if r.validation is not None and r.workload is not None:
        w = r.workload
        header = (
            f"Validation on simulated backends: {w.shape}, {counted(w.requests, 'request')}, "
            f"{counted(w.groups, 'group')}, {w.shared_tokens}-token shared prompts, "
            f"{w.question_tokens}-token questions, {counted(w.max_tokens, 'output token')}, "
            f"Poisson {w.rate:.3g} req/s (simulated time)"
        )
        print("\n" + textwrap.fill(header, _WIDTH))
        print(table(r.validation))
        for line in reading(r.validation):
            print(line)
        print(textwrap.fill(f"Verdict: {favoured(r.validation)[1]}.", _WIDTH))


def _prefix_lines(p: Prefixes) -> list[str]:
    d = _prefix_doc(p)
    shared = d["shared_tokens"]
    lines = [
        f"Shared prefixes, in {p.tokens}, to the {p.block_size}-token block:",
        f"  globally shared (by {NEARLY_ALL:.0%}+ of the requests): {p.global_tokens} tokens",
    ]
    if p.groups:
        sizes, parts = d["group_requests"], d["group_shared_tokens"]
        lines.append(
            f"  {len(p.groups)} groups share more: {sizes['p50']:.0f} requests each (median, "
            f"max {sizes['max']:.0f}), their shared part {parts['p10']:.0f} / "
            f"{parts['p50']:.0f} / {parts['max']:.0f} tokens (P10 / median / max)"
        )
    else:
        lines.append("  no group of requests shares more than that")
    histogram = ", ".join(f"{k}: {v}" for k, v in d["shared_histogram"].items())
    lines += [
        f"  tokens each request shares with an earlier one: P10 {shared['p10']:.0f}, "
        f"P50 {shared['p50']:.0f}, P90 {shared['p90']:.0f}, max {shared['max']:.0f}",
        f"  requests by tokens shared: {histogram}",
        f"  re-used prompt tokens: {p.reuse_all:.0%} (an unbounded cache's hit rate), "
        f"{p.reuse:.0%} past the global part",
    ]
    return lines


def _load_lines(f: Facts) -> list[str]:
    c = f.concurrency
    if c is None:
        load = "Concurrency: unknown (no request has at and duration_ms)"
    else:
        rate = f"{c.rate:.3g} req/s, " if c.rate else ""
        load = (
            f"Concurrency: {rate}in flight as a request arrives: fleet P50 {c.fleet_p50:.0f}, "
            f"P99 {c.fleet_p99:.0f}, max {c.fleet_max}; one backend ({c.backends}) "
            f"P50 {c.backend_p50:.0f}, P99 {c.backend_p99:.0f}, max {c.backend_max}"
        )
    rate = f.prefill.tokens_per_s
    prefill = (
        f"about {rate:,.0f} tokens/s ({f.prefill.why})" if rate else f"unknown: {f.prefill.why}"
    )
    return [load, f"Prefill: {prefill}"]


# --- command line -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute recommend",
        description=(
            "Advise a routing strategy and its parameters from a router's data capture (JSON\n"
            "lines, .gz too) or a bench workload, each with its reason; --validate runs the\n"
            "advice and the runner-up on simulated backends."
        ),
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("captures", nargs="*", metavar="CAPTURE", help="capture files (JSON lines)")
    fleet = p.add_argument_group("the fleet the advice is for")
    fleet.add_argument(
        "--replicas", type=positive(int), default=1, help="router replicas (default 1)"
    )
    fleet.add_argument(
        "--kv-events",
        action="store_true",
        help="the backends publish KV events, so replicas share what they learn",
    )
    fleet.add_argument(
        "--backends",
        type=positive(int),
        help="backends (default: those the capture names; for a workload and --validate "
        f"{DEFAULT_BACKENDS})",
    )
    tokens = p.add_argument_group("how prompts are counted")
    tokens.add_argument(
        "--tokenizer",
        choices=("approx", "chatml4"),
        default="approx",
        help="approx: PREFIX_AWARE's (prefix_length is in its tokens; the default); "
        "chatml4: the simulator's, what KV_AWARE and the KV cache count",
    )
    tokens.add_argument(
        "--chars-per-token", type=positive(float), default=4.0, help="approx's (4.0)"
    )
    tokens.add_argument("--block-size", type=positive(int), default=16, help="KV block tokens (16)")
    work = p.add_argument_group("a workload instead of a capture (bench/harness/workloads.py)")
    add_workload_options(work)
    work.add_argument(
        "--rate", type=float, help=f"Poisson arrivals per s (default {DEFAULT_RATE:g})"
    )
    work.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    p.set_defaults(workload=None)
    check = p.add_argument_group("validation and output")
    check.add_argument(
        "--validate",
        action="store_true",
        help="run the advice and the runner-up with the bench harness on simulated backends, "
        "on a workload matched to the traffic (--requests of them at most)",
    )
    check.add_argument(
        "--time-scale",
        type=positive(float),
        default=DEFAULT_TIME_SCALE,
        help=f"simulated durations x this ({DEFAULT_TIME_SCALE:g})",
    )
    check.add_argument(
        "--max-wall", type=positive(float), default=600.0, help="wall seconds per row (600)"
    )
    check.add_argument("--json", action="store_true", help="one JSON document on stdout")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.captures) == bool(args.workload):
        parser.error("give capture files or --workload (one of them)")
    try:
        traffic, spec = _traffic(args)
        tokens = Tokens(args.tokenizer, args.chars_per_token, args.block_size)
        facts = Facts(
            prefixes(traffic, tokens),
            concurrency(traffic, args.backends),
            prefill_rate(traffic),
            args.replicas,
            args.kv_events,
        )
    except (TrafficError, ValueError) as exc:
        print(f"kvroute recommend: {exc}", file=sys.stderr)
        return 2
    settings = advise(facts)
    validation = None
    if args.validate:
        c = facts.concurrency
        backends = args.backends or (c.backends if args.captures and c else DEFAULT_BACKENDS)
        if spec is None:
            spec = matched_workload(facts.prefixes, traffic, c, args.requests, args.seed)
        try:
            validation = _validate(settings, spec, backends, args)
        except HarnessError as exc:
            print(f"kvroute recommend: {exc}", file=sys.stderr)
            return 1
    report = _Report(traffic, facts, settings, spec, validation)
    (_print_json if args.json else _print_text)(report)
    return 0


def _traffic(args: argparse.Namespace) -> tuple[Traffic, WorkloadSpec | None]:
    """The capture's traffic (and no workload yet), or the workload's and its spec."""
    if args.captures:
        traffic = read_capture(args.captures)
        for path in traffic.unfinished:
            print(
                f"kvroute recommend: warning: {path} ends mid-record (still being written, "
                "or its writer was killed); read up to its last complete line",
                file=sys.stderr,
            )
        return traffic, None
    spec = msgspec.structs.replace(workload_spec(args, args.rate or DEFAULT_RATE), seed=args.seed)
    return from_workload(spec, args.backends or DEFAULT_BACKENDS), spec


if __name__ == "__main__":
    sys.exit(main())
