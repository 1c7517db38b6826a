"""`python -m bench.studies.batch_impact`: what a batch running beside interactive traffic costs
that traffic.

One seeded interactive workload is replayed twice, each time on a fresh simulated fleet
behind kvroute as `kvroute serve` starts it (one worker per usable core, KV_AWARE, KV
events off) with `jobs` on: once alone, and once with a batch of `--batch-lines`
requests (OpenAI's Files and Batch API, through the router) submitted just before it.
The batch takes spare capacity only (`jobs.spare_share`, `jobs.concurrency`), so the
interactive TTFT should barely move. One row per run: interactive TTFT p50/p90/p99,
failures, the batch lines done by the time the interactive replay ended, and (the batch
waited for after it) the lines answered and how long the batch took. Latencies are in
simulated time.

Reproduces docs/performance.md, "A batch beside interactive traffic".
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import msgspec

from bench.harness.loadgen import Outcome
from bench.harness.report import percentile
from bench.harness.routed import MODEL, replay_routed, run_main
from bench.harness.workloads import SHAPES, WorkloadSpec, generate
from router.config import build


class Run(msgspec.Struct, frozen=True, kw_only=True):
    batch: bool
    ok: int
    failed: int
    ttft: tuple[float | None, float | None, float | None]  # p50, p90, p99, simulated s
    lines_done: int | None  # batch lines finished when the interactive replay ended
    batch_s: float | None  # from its submission to its end, simulated s
    batch_ok: int | None  # lines answered below 400, in the end


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.studies.batch_impact", description=__doc__.split("\n")[0]
    )
    p.add_argument("--backends", type=int, default=4, help="simulated backends")
    p.add_argument("--workload", choices=sorted(SHAPES), default="short-prefix")
    p.add_argument("--requests", type=int, default=200, help="interactive requests")
    p.add_argument("--rate", type=float, default=4.0, help="interactive requests a second")
    p.add_argument("--groups", type=int, default=20, help="prefix groups")
    p.add_argument("--max-tokens", type=int, default=50, help="output tokens a request")
    p.add_argument("--batch-lines", type=int, default=400, help="requests in the batch")
    p.add_argument("--batch-max-tokens", type=int, default=100, help="output tokens a line")
    p.add_argument("--spare-share", type=float, help="jobs.spare_share (else its default)")
    p.add_argument("--concurrency", type=int, help="jobs.concurrency (else its default)")
    p.add_argument("--time-scale", type=float, default=0.5, help="simulated durations x this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-wall", type=float, default=600.0, help="wall seconds, then cancel")
    p.add_argument("--out", type=Path, metavar="FILE", help="write the runs as JSON")
    return p


def router_config(args: argparse.Namespace, backends: list[dict], jobs_db: Path) -> dict:
    jobs: dict[str, object] = {"enabled": True, "path": str(jobs_db)}
    if args.spare_share is not None:
        jobs["spare_share"] = args.spare_share
    if args.concurrency is not None:
        jobs["concurrency"] = args.concurrency
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": backends,
        "jobs": jobs,
        "log_level": "warning",
    }
    build(config, "bench.studies.batch_impact")  # a bad flag fails here, before anything starts
    return config


def batch_input(args: argparse.Namespace) -> bytes:
    """Distinct prompts (nothing shared with the interactive traffic or each other)."""
    lines = []
    for i in range(args.batch_lines):
        text = f"Batch document {i}: summarise the quarterly report section {i} in detail."
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
        body["max_tokens"] = args.batch_max_tokens
        line = {"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions"}
        lines.append(msgspec.json.encode({**line, "body": body}))
    return b"\n".join(lines) + b"\n"


@asynccontextmanager
async def batch_running(
    args: argparse.Namespace, http: aiohttp.ClientSession, url: str, found: dict
) -> AsyncIterator[None]:
    """A batch submitted before the replay; its progress read when the replay ends."""
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", batch_input(args), filename="batch.jsonl")
    async with http.post(url + "/v1/files", data=form) as r:
        r.raise_for_status()
        file_id = (await r.json())["id"]
    asked = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    async with http.post(url + "/v1/batches", json={**asked, "completion_window": "24h"}) as r:
        r.raise_for_status()
        batch_id = (await r.json())["id"]
    submitted = time.monotonic()
    yield
    batch = await _batch(http, url, batch_id)
    counts = batch["request_counts"]
    found["lines_done"] = counts["completed"] + counts["failed"]
    async with asyncio.timeout(args.max_wall):
        while batch["status"] != "completed":
            await asyncio.sleep(0.1)
            batch = await _batch(http, url, batch_id)
    found["batch_s"] = (time.monotonic() - submitted) / args.time_scale
    found["batch_ok"] = batch["request_counts"]["completed"]


async def _batch(http: aiohttp.ClientSession, url: str, batch_id: str) -> dict:
    async with http.get(f"{url}/v1/batches/{batch_id}") as r:
        r.raise_for_status()
        return await r.json()


def summarize(batch: bool, outcomes: list[Outcome], found: dict, scale: float) -> Run:
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft / scale for o in ok if o.ttft is not None]
    return Run(
        batch=batch,
        ok=len(ok),
        failed=len(outcomes) - len(ok),
        ttft=(percentile(ttft, 0.5), percentile(ttft, 0.9), percentile(ttft, 0.99)),
        lines_done=found.get("lines_done"),
        batch_s=found.get("batch_s"),
        batch_ok=found.get("batch_ok"),
    )


def table(runs: Sequence[Run]) -> str:
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1e3:.0f}"

    base = runs[0].ttft[1]
    lines = [
        "run               ok  fail  TTFT p50   p90   p99  p90 vs alone  lines by then"
        "  batch ok  batch s"
    ]
    for r in runs:
        name = "with a batch" if r.batch else "alone"
        ratio = "" if not (base and r.ttft[1]) else f"{r.ttft[1] / base - 1:+.1%}"
        done = "" if r.lines_done is None else str(r.lines_done)
        ok = "" if r.batch_ok is None else str(r.batch_ok)
        took = "" if r.batch_s is None else f"{r.batch_s:.0f}"
        lines.append(
            f"{name:<15} {r.ok:>4} {r.failed:>5} {ms(r.ttft[0]):>9} {ms(r.ttft[1]):>5} "
            f"{ms(r.ttft[2]):>5} {ratio:>13} {done:>14} {ok:>9} {took:>8}"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> int:
    workload = WorkloadSpec(
        shape=args.workload, requests=args.requests, groups=args.groups,
        max_tokens=args.max_tokens, rate=args.rate, seed=args.seed,
    )  # fmt: skip
    specs = generate(workload)
    runs = []
    for with_batch in (False, True):
        found: dict = {}
        with tempfile.TemporaryDirectory(prefix="kvroute-jobs-") as tmp:
            db = Path(tmp) / "jobs.db"
            during = None
            if with_batch:

                def during(http: aiohttp.ClientSession, url: str, found: dict = found):
                    return batch_running(args, http, url, found)

            routed = await replay_routed(
                args.backends, [], lambda fleet, db=db: router_config(args, fleet, db), specs,
                time_scale=args.time_scale, max_wall=args.max_wall, seed=args.seed,
                during=during,
            )  # fmt: skip
        runs.append(summarize(with_batch, routed.outcomes, found, args.time_scale))
    print(table(runs))
    failed = sum(r.failed for r in runs)
    if args.out is not None:
        args.out.write_bytes(msgspec.json.encode({"runs": runs, "argv": sys.argv[1:]}))
    return 0 if failed == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
