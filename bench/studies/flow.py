"""Flow control past saturation: fair share, priorities and clean refusals, on and off.

Four simulated vLLM backends (bench/sim, a process of their own) with few batch slots
each, so capacity is small and measured first (closed loop). Then, open loop (Poisson
arrivals), each scenario runs once alone and twice at 1.5x capacity, flow control on
and off, each run through a new `kvroute serve` (its own process, the default workers,
as users run it; in this process, the load's and the simulator's garbage collection
paused the router too):

- **tenants**: a quiet tenant at a quarter of capacity, alone; then beside a noisy one
  sending five times as much (1.5x capacity together). Measure: the quiet tenant's TTFT
  P99 against its value alone.
- **classes**: `critical` at 0.4x capacity, alone; then beside `sheddable` at 1.1x.
  Measure: critical's TTFT P99 against its value alone, and who absorbs the refusals.

"Off" is today's behaviour: no saturation gate, no classes (`priority_header: null`),
every request goes to vLLM's FIFO queue. With `--peers`, each scenario's loaded run also
goes through sglang-router and vllm-router (round_robin) with their flow control set to
the fleet's batch slots: `--max-concurrent-requests` (4 x `--seqs`), a FIFO queue
(`--queue-size 4096`, `--queue-timeout-secs 10`); their PyPI builds have no classes and no
tenants, and refuse without a reason header. Each run's first `--warmup` seconds of load are
not counted (a new router learns each backend's batch limit at its first saturation; a
router in service has long learned it). Every request after is counted: sent =
answered + refused (each refusal's `x-kvroute-drop-reason`) + failed; a refusal's
latency is checked against its class's `queue_timeout`.

    python -m bench.studies.flow --seconds 60 [--scenarios tenants] [--peers]

Reproduces docs/performance.md, "Flow control past saturation".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.harness.peers import PEERS_VENV, ensure_peers, peer_cmd
from bench.harness.processes import (
    free_port,
    kvroute_serve,
    logged,
    simulator,
    until_200,
    wait_ready,
)

PATH = "/v1/chat/completions"
#: the classes' waits with flow control on, seconds
QUEUE_TIMEOUT = {"standard": 10.0, "critical": 10.0, "sheddable": 2.0}


@dataclass
class Tally:
    """What one tenant's requests got."""

    ttfts: list[float] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)
    refused_after: list[float] = field(default_factory=list)
    sent: int = 0
    failed: int = 0

    def p99(self) -> float | None:
        if not self.ttfts:
            return None
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def router_config(backends: list[dict], flow_on: bool, reserve: float | None = None) -> dict:
    """The router's config; `reserve`: flow.saturation.reserve (None: the default)."""
    classes = {name: {"queue_timeout": t} for name, t in QUEUE_TIMEOUT.items()}
    saturation = {"max_waiting": 0} | ({} if reserve is None else {"reserve": reserve})
    flow = (
        {
            "tenants": {"crit": {"priority": "critical"}},
            "classes": classes,
            "saturation": saturation,
        }
        if flow_on
        else {"priority_header": None, "saturation": {"enabled": False}}
    )
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": backends,
        "routing": {"strategy": "LEAST_OUTSTANDING_REQUESTS"},
        "telemetry": {"scrape_interval": 0.05},
        "tenant_header": "X-Tenant",
        "limits": {"queue_size": 4096, "queue_timeout": 10},
        "flow": flow,
        "access_log": {"enabled": False},
    }


async def one(http: aiohttp.ClientSession, url: str, tally: Tally, headers: dict) -> None:
    """One streamed chat request: its TTFT, or its refusal and reason."""
    body = {
        "model": "sim-llama-70b",
        "messages": [{"role": "user", "content": f"q {random.random()}"}],
        "max_tokens": random.randint(8, 24),  # answers of one length finish in step
        "stream": True,
    }
    tally.sent += 1
    t0 = time.perf_counter()
    try:
        async with http.post(url + PATH, json=body, headers=headers) as resp:
            if resp.status != 200:
                await resp.read()
                reason = resp.headers.get("x-kvroute-drop-reason", f"no reason ({resp.status})")
                tally.refused[reason] += 1
                tally.refused_after.append(time.perf_counter() - t0)
                return
            first = None
            async for _ in resp.content.iter_any():
                if first is None:
                    first = time.perf_counter() - t0
            tally.ttfts.append(first or 0.0)
    except (aiohttp.ClientError, TimeoutError):
        tally.failed += 1


async def offer(
    url: str, loads: dict[str, tuple[float, dict]], seconds: float, warmup: float = 0.0
) -> dict:
    """Poisson arrivals at each tenant's rate for `warmup` then `seconds`; every request
    awaited, those sent in the warm-up not counted. The load's own garbage collector is
    off meanwhile: its passes over thousands of requests' tasks paused the clients'
    reading for tens of milliseconds, counted as the router's TTFT."""
    gc.disable()
    try:
        return await _offer(url, loads, seconds, warmup)
    finally:
        gc.enable()
        gc.collect()


async def _offer(
    url: str, loads: dict[str, tuple[float, dict]], seconds: float, warmup: float
) -> dict:
    tallies = {name: Tally() for name in loads}
    warming = {name: Tally() for name in loads}
    timeout = aiohttp.ClientTimeout(total=120)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
        tasks: list[asyncio.Task] = []

        async def arrivals(name: str, rate: float, headers: dict) -> None:
            counted = time.perf_counter() + warmup
            end = counted + seconds
            while (now := time.perf_counter()) < end:
                tally = tallies[name] if now >= counted else warming[name]
                tasks.append(asyncio.create_task(one(http, url, tally, headers)))
                await asyncio.sleep(random.expovariate(rate))

        await asyncio.gather(*(arrivals(n, r, h) for n, (r, h) in loads.items()))
        await asyncio.gather(*tasks)
    return tallies


async def capacity(url: str, seconds: float) -> float:
    """Requests per second the fleet completes under a closed loop of many clients."""
    done = 0
    end = time.perf_counter() + seconds
    async with aiohttp.ClientSession() as http:

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < end:
                tally = Tally()
                await one(http, url, tally, {})
                done += len(tally.ttfts)

        await asyncio.gather(*(client() for _ in range(64)))
    return done / seconds


@contextlib.asynccontextmanager
async def serving(
    backends: list[dict], flow_on: bool, reserve: float | None = None
) -> AsyncIterator[str]:
    """`kvroute serve` in front of `backends`, as users run it (its own process, the
    default workers); yields its URL."""
    port = free_port()
    config = router_config(backends, flow_on, reserve)
    config["listen"]["port"] = port
    with tempfile.TemporaryDirectory() as work:
        path = Path(work)
        with logged(kvroute_serve(config, path / "router.yaml"), path / "router.log"):
            url = f"http://127.0.0.1:{port}"
            await wait_ready(url)
            yield url


async def with_router(
    backends: list[dict], flow_on: bool, loads: dict, args: argparse.Namespace
) -> dict:
    async with serving(backends, flow_on, args.reserve) as url:
        return await offer(url, loads, args.seconds, args.warmup)


@contextlib.asynccontextmanager
async def peer_serving(
    python: Path, package: str, backends: list[dict], slots: int
) -> AsyncIterator[str]:
    """The peer in front of `backends`, its concurrency cap at the fleet's `slots` and a
    FIFO queue as long as kvroute's; yields its URL once it answers."""
    port = free_port()
    cmd = peer_cmd(python, package, [b["url"] for b in backends], port)
    cmd += ["--max-concurrent-requests", str(slots), "--queue-size", "4096"]
    cmd += ["--queue-timeout-secs", f"{QUEUE_TIMEOUT['standard']:.0f}"]
    with tempfile.TemporaryDirectory() as work:
        with logged(cmd, Path(work) / "peer.log") as proc:
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as http:
                code = await until_200(lambda: http.get(url + "/readiness"), proc.poll, 40, 0.2)
            if code is not None:
                raise RuntimeError(f"{package} exited with code {code}")
            yield url


def peers(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """The peers to run (with `--peers`): (package, its virtualenv's python); one that
    cannot run is said and skipped."""
    if not args.peers:
        return []
    found = []
    for package, (python, why) in ensure_peers(PEERS_VENV, install=True).items():
        if python is None:
            print(f"{package}: not measured: {why}", file=sys.stderr)
        else:
            found.append((package, python))
    return found


def row(label: str, name: str, tally: Tally, alone: float | None) -> str:
    p99 = tally.p99()
    ratio = f"{p99 / alone:.2f}x" if p99 is not None and alone else "-"
    refused = ", ".join(f"{k} {v}" for k, v in sorted(tally.refused.items())) or "0"
    answered = len(tally.ttfts)
    counted = "yes" if tally.sent == answered + sum(tally.refused.values()) + tally.failed else "NO"
    late = max(tally.refused_after, default=0.0)
    p99s = f"{p99 * 1000:.0f}" if p99 is not None else "-"
    return (
        f"| {label} | {name} | {tally.sent} | {answered} | {refused} | {tally.failed} | "
        f"{counted} | {p99s} | {ratio} | {late:.1f} |"
    )


async def run(args: argparse.Namespace) -> str:
    sim = ["--max-num-seqs", str(args.seqs)]
    found = peers(args)
    async with simulator(4, args.time_scale, sim) as (backends, _):
        async with serving(backends, False) as url:
            cap = await capacity(url, args.probe_seconds)
        quiet = {"quiet": (0.25 * cap, {"X-Tenant": "quiet"})}
        noisy = {**quiet, "noisy": (1.25 * cap, {"X-Tenant": "noisy"})}
        crit = {"critical": (0.4 * cap, {"X-Tenant": "crit"})}
        shed = {**crit, "sheddable": (1.1 * cap, {"X-Kvroute-Priority": "sheddable"})}
        lines = [
            f"capacity {cap:.1f} req/s (4 backends, max_num_seqs {args.seqs}); "
            f"{args.seconds:.0f} s counted per run, after {args.warmup:.0f} s not counted; "
            f"saturation.reserve {'default' if args.reserve is None else args.reserve}",
            "",
            "| run | tenant/class | sent | answered | refused (reason) | failed | "
            "sent = answered + refused + failed | TTFT P99 ms | vs alone | "
            "longest refusal s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        scenarios = (
            ("tenants", quiet, noisy, "quiet"),
            ("classes", crit, shed, "critical"),
        )
        for scenario, alone_load, loaded, probe in scenarios:
            if scenario not in args.scenarios:
                continue
            alone = await with_router(backends, True, alone_load, args)
            base = alone[probe].p99()
            lines.append(row(f"{scenario}: alone", probe, alone[probe], base))
            for flow_on in (True, False):
                got = await with_router(backends, flow_on, loaded, args)
                label = f"{scenario}: 1.5x, flow {'on' if flow_on else 'off'}"
                lines += [row(label, name, got[name], base) for name in loaded]
            for package, python in found:
                async with peer_serving(python, package, backends, 4 * args.seqs) as url:
                    got = await offer(url, loaded, args.seconds, args.warmup)
                label = f"{scenario}: 1.5x, {package}"
                lines += [row(label, name, got[name], base) for name in loaded]
        return "\n".join(lines)


SCENARIOS = ("tenants", "classes")


def _scenarios(text: str) -> set[str]:
    names = set(text.split(","))
    if unknown := names - set(SCENARIOS):
        known = ", ".join(SCENARIOS)
        raise argparse.ArgumentTypeError(f"unknown {sorted(unknown)}; known: {known}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="each run's counted length")
    parser.add_argument(
        "--warmup",
        type=float,
        default=3.0,
        help="each run's first seconds of load, not counted: a new router learns each "
        "backend's batch limit at its first saturation (its requests are awaited)",
    )
    parser.add_argument("--probe-seconds", type=float, default=8.0, help="capacity probe")
    parser.add_argument("--seqs", type=int, default=4, help="max_num_seqs per backend")
    parser.add_argument(
        "--reserve",
        type=float,
        default=None,
        help="flow.saturation.reserve with flow control on (default: the router's)",
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="the sim's clock")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="also sglang-router and vllm-router (round_robin), capped at the fleet's batch "
        "slots with a FIFO queue",
    )
    parser.add_argument(
        "--scenarios",
        type=_scenarios,
        default=set(SCENARIOS),
        help="which to run, comma-separated: tenants, classes (default: both)",
    )
    args = parser.parse_args(argv)
    print(asyncio.run(run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
