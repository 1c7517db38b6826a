"""`python -m bench.studies.pools`: a preferred pool and a fallback pool under a load ramp.

One simulated fleet (`--preferred` + `--fallback` backends, one child process), and
kvroute as `kvroute serve` starts it (one worker per usable core) with the two pools in
front of it, the preferred pool saturating at the strategy's cap
(`--concurrency-threshold`, or KV_AWARE's `--max-queue-s`). The workload is replayed in
stages of rising then falling Poisson rates (`--stages`, requests per simulated second,
`--stage-requests` each); one table row per stage: what was served, what failed (every
request must succeed), the share the fallback took, TTFT per pool, and the router's
spill counts (kvroute_pool_spills_total). Latencies are in simulated time.

Reproduces docs/performance.md, "Pools under a load ramp".
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec

from bench.harness.loadgen import Outcome
from bench.harness.report import percentile
from bench.harness.routed import replay_routed, run_main
from bench.harness.workloads import SHAPES, RequestSpec, WorkloadSpec, generate
from router.config import build

_SPILLS = "kvroute_pool_spills_total"


class Stage(msgspec.Struct, frozen=True, kw_only=True):
    rate: float
    ok: int
    failed: int
    fallback_share: float | None
    ttft_preferred: tuple[float | None, float | None]  # p50, p90, simulated s
    ttft_fallback: tuple[float | None, float | None]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.studies.pools", description=__doc__.split("\n")[0]
    )
    p.add_argument("--preferred", type=int, default=2, help="backends in the preferred pool")
    p.add_argument("--fallback", type=int, default=2, help="backends in the fallback pool")
    p.add_argument("--strategy", default="KV_AWARE", help="the routing strategy")
    p.add_argument("--concurrency-threshold", type=int, help="each backend's request cap")
    p.add_argument("--max-queue-s", type=float, help="KV_AWARE: the estimated-queue cap")
    p.add_argument(
        "--stages",
        default="1,2,4,8,4,2,1",
        help="comma-separated Poisson rates, requests per simulated second",
    )
    p.add_argument("--stage-requests", type=int, default=60, help="requests per stage")
    p.add_argument("--workload", choices=sorted(SHAPES), default="short-prefix")
    p.add_argument("--groups", type=int, default=20, help="prefix groups")
    p.add_argument("--max-tokens", type=int, default=50, help="output tokens per request")
    p.add_argument("--time-scale", type=float, default=0.5, help="simulated durations x this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-wall", type=float, default=600.0, help="wall seconds, then cancel")
    p.add_argument("--out", type=Path, metavar="FILE", help="write the stages as JSON")
    return p


def ramp(args: argparse.Namespace, rates: Sequence[float]) -> list[list[RequestSpec]]:
    """Each stage's requests, arrivals continuing from where the stage before ended
    (the same documents throughout, so affinity carries over the stages)."""
    stages, offset, index = [], 0.0, 0
    for i, rate in enumerate(rates):
        workload = WorkloadSpec(
            shape=args.workload,
            requests=args.stage_requests,
            groups=args.groups,
            max_tokens=args.max_tokens,
            rate=rate,
            seed=args.seed * 1000 + i,
        )
        specs = [
            msgspec.structs.replace(s, index=index + k, arrival=offset + (s.arrival or 0.0))
            for k, s in enumerate(generate(workload))
        ]
        stages.append(specs)
        offset, index = specs[-1].arrival or offset, index + len(specs)
    return stages


def router_config(args: argparse.Namespace, backends: list[dict]) -> dict:
    routing: dict[str, object] = {"strategy": args.strategy, "seed": args.seed}
    if args.concurrency_threshold is not None:
        routing["concurrency_threshold"] = args.concurrency_threshold
    if args.max_queue_s is not None:
        routing["max_queue_s"] = args.max_queue_s
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [
            {"name": "preferred", "priority": 0, "backends": backends[: args.preferred]},
            {"name": "fallback", "priority": 1, "backends": backends[args.preferred :]},
        ],
        "routing": routing,
        "log_level": "warning",
    }
    build(config, "bench.studies.pools")  # a bad flag fails here, before anything starts
    return config


def summarize(
    rates: Sequence[float], stages: list[list[RequestSpec]], outcomes: list[Outcome],
    fallback: set[str], time_scale: float,
) -> list[Stage]:  # fmt: skip
    out = []
    for rate, specs in zip(rates, stages, strict=True):
        mine = [outcomes[s.index] for s in specs]
        ok = [o for o in mine if o.ok]
        spilled = [o for o in ok if o.backend in fallback]
        out.append(
            Stage(
                rate=rate,
                ok=len(ok),
                failed=len(mine) - len(ok),
                fallback_share=len(spilled) / len(ok) if ok else None,
                ttft_preferred=_p50_p90([o for o in ok if o.backend not in fallback], time_scale),
                ttft_fallback=_p50_p90(spilled, time_scale),
            )
        )
    return out


def _p50_p90(outcomes: list[Outcome], time_scale: float) -> tuple[float | None, float | None]:
    ttft = [o.ttft / time_scale for o in outcomes if o.ttft is not None]
    return percentile(ttft, 0.5), percentile(ttft, 0.9)


def table(stages: Sequence[Stage]) -> str:
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1e3:.0f}"

    lines = ["rate/s   ok  fail  fallback  TTFT pref p50   p90  TTFT fallback p50   p90"]
    for s in stages:
        share = "n/a" if s.fallback_share is None else f"{s.fallback_share:.0%}"
        lines.append(
            f"{s.rate:>6g} {s.ok:>4} {s.failed:>5} {share:>9} {ms(s.ttft_preferred[0]):>14} "
            f"{ms(s.ttft_preferred[1]):>5} {ms(s.ttft_fallback[0]):>18} {ms(s.ttft_fallback[1]):>5}"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> int:
    rates = [float(r) for r in args.stages.split(",") if r.strip()]
    stages = ramp(args, rates)
    specs = [s for stage in stages for s in stage]
    routed = await replay_routed(
        args.preferred + args.fallback, [], lambda fleet: router_config(args, fleet), specs,
        time_scale=args.time_scale, max_wall=args.max_wall, seed=args.seed,
    )  # fmt: skip
    fallback = {b["name"] for b in routed.backends[args.preferred :]}
    found = summarize(rates, stages, routed.outcomes, fallback, args.time_scale)
    print(table(found))
    spills = {
        dict(labels).get("reason", ""): value - routed.before.get((name, labels), 0.0)
        for (name, labels), value in routed.after.items()
        if name == _SPILLS and dict(labels).get("pool") == "preferred"
    }
    print(f"spills from the preferred pool: {spills or 'none'}")
    failed = sum(s.failed for s in found)
    print(f"{len(specs)} requests, {failed} failed")
    if args.out is not None:
        report = {"stages": found, "spills": spills, "argv": sys.argv[1:]}
        args.out.write_bytes(msgspec.json.encode(report))
    return 0 if failed == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
