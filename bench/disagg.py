"""`python -m bench.disagg --pd P:D`: prefill/decode disaggregation against as many
combined backends, on one seeded workload.

Two runs, each on a fresh simulated fleet of P + D backends behind kvroute as
`kvroute serve` starts it (one worker per usable core, the default strategy):
disaggregated (P prefill and D decode backends in a prefill and a decode pool, vLLM's
kv_transfer_params between them) and combined (the same P + D backends, each serving
whole requests). One row each: what was served, TTFT, inter-token latency and
end-to-end latency percentiles, in simulated ms. The trade: a decode backend never
stalls its running streams for a long prefill (ITL), while a request pays the transfer
and has P backends, not P + D, to prefill on (TTFT under load).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import msgspec

from bench.loadgen import Outcome
from bench.report import percentile
from bench.routed import replay_routed, run_main
from bench.workloads import SHAPES, WorkloadSpec, generate
from router.config import build


class Row(msgspec.Struct, frozen=True, kw_only=True):
    mode: str
    ok: int
    failed: int
    ttft: tuple[float | None, float | None]  # p50, p90, simulated s
    itl: tuple[float | None, float | None]  # p50, p99
    e2e_p50: float | None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.disagg", description=__doc__.split("\n")[0])
    p.add_argument("--pd", default="1:1", metavar="P:D", help="prefill and decode backends")
    p.add_argument("--workload", choices=sorted(SHAPES), default="long-prefix")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--groups", type=int, default=20, help="prefix groups")
    p.add_argument("--rate", type=float, default=1.0, help="requests per simulated second")
    p.add_argument("--max-tokens", type=int, default=100, help="output tokens per request")
    p.add_argument("--time-scale", type=float, default=0.5, help="simulated durations x this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-wall", type=float, default=600.0, help="wall seconds per run")
    return p


def split(pd: str) -> tuple[int, int]:
    prefill, sep, decode = pd.partition(":")
    if not sep or not prefill.isdigit() or not decode.isdigit() or "0" in (prefill, decode):
        raise ValueError(f"--pd: expected P:D with P, D >= 1, got {pd!r}")
    return int(prefill), int(decode)


def disaggregated(prefill: int, fleet: list[dict]) -> dict:
    pools = [
        {"name": "prefill", "priority": 0, "role": "prefill", "backends": fleet[:prefill]},
        {"name": "decode", "priority": 1, "role": "decode", "backends": fleet[prefill:]},
    ]
    return _config({"pools": pools})


def combined(fleet: list[dict]) -> dict:
    return _config({"backends": fleet})


def _config(backends: dict) -> dict:
    config = {"listen": {"host": "127.0.0.1", "port": 0}, "log_level": "warning", **backends}
    build(config, "bench.disagg")
    return config


def row(mode: str, outcomes: list[Outcome], time_scale: float) -> Row:
    ok = [o for o in outcomes if o.ok]

    def scaled(values: list[float], q: float) -> float | None:
        found = percentile(values, q)
        return None if found is None else found / time_scale

    ttft = [o.ttft for o in ok if o.ttft is not None]
    itl = [gap for o in ok for gap in o.itl]
    e2e = [o.e2e for o in ok if o.e2e is not None]
    return Row(
        mode=mode,
        ok=len(ok),
        failed=len(outcomes) - len(ok),
        ttft=(scaled(ttft, 0.5), scaled(ttft, 0.9)),
        itl=(scaled(itl, 0.5), scaled(itl, 0.99)),
        e2e_p50=scaled(e2e, 0.5),
    )


def table(rows: Sequence[Row]) -> str:
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1e3:.0f}"

    lines = ["mode                ok  fail  TTFT p50   p90  ITL p50   p99  E2E p50"]
    for r in rows:
        lines.append(
            f"{r.mode:<18} {r.ok:>3} {r.failed:>5} {ms(r.ttft[0]):>9} {ms(r.ttft[1]):>5} "
            f"{ms(r.itl[0]):>8} {ms(r.itl[1]):>5} {ms(r.e2e_p50):>8}"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> int:
    prefill, decode = split(args.pd)
    workload = WorkloadSpec(
        shape=args.workload,
        requests=args.requests,
        groups=args.groups,
        max_tokens=args.max_tokens,
        rate=args.rate,
        seed=args.seed,
    )
    specs = generate(workload)
    roles = ["--roles", *["prefill"] * prefill, *["decode"] * decode]
    runs = (
        (f"disaggregated {prefill}:{decode}", roles, lambda f: disaggregated(prefill, f)),
        (f"combined {prefill + decode}", [], combined),
    )
    rows = []
    for mode, sim_args, config in runs:
        routed = await replay_routed(
            prefill + decode, sim_args, config, specs,
            time_scale=args.time_scale, max_wall=args.max_wall, seed=args.seed,
        )  # fmt: skip
        rows.append(row(mode, routed.outcomes, args.time_scale))
    print(table(rows))
    print("latencies in simulated ms; the router as kvroute serve starts it")
    return 0 if all(r.failed == 0 for r in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
