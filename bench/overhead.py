"""Added latency of the router over calling the backend directly, in the same run.

An instant backend (`bench.instant_backend`) and a router in front of it run as separate
processes; one client alternates batches of direct and routed requests so both see the
same machine noise, sequentially and at a fixed concurrency. The figure that matters is
the difference of the two distributions (router - direct), not either alone.

    python -m bench.overhead --requests 2000 --concurrency 64

The router runs as `kvroute serve` starts by default (its strategy, a worker per core);
`--strategy` and `--workers` measure others.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import aiohttp
import orjson

from router.config import DEFAULT_STRATEGY

_BODY = orjson.dumps(
    {"model": "instant", "messages": [{"role": "user", "content": "ping " * 50}], "max_tokens": 1}
)
_HEADERS = {"Content-Type": "application/json"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process(cmd: list[str]) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def backend_and_router(strategy: str, workers: int = 1) -> Iterator[tuple[str, str]]:
    """Start the instant backend and a router in front of it; yield both URLs."""
    py = sys.executable
    with process([py, "-m", "bench.instant_backend", "--port", "0"]) as backend:
        backend_url = backend.stdout.readline().strip()
        port = free_port()
        cmd = [py, "-m", "router", "serve", "--port", str(port), "--backend", backend_url]
        cmd += ["--workers", str(workers), "--strategy", strategy, "--log-level", "warning"]
        with process(cmd):
            router_url = f"http://127.0.0.1:{port}"
            asyncio.run(wait_ready(router_url))
            yield backend_url, router_url


async def wait_ready(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url + "/ready") as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not become ready")
            await asyncio.sleep(0.1)


async def _one(http: aiohttp.ClientSession, url: str) -> float:
    t0 = time.perf_counter()
    async with http.post(url, data=_BODY, headers=_HEADERS) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}")
    return time.perf_counter() - t0


async def _batch(http: aiohttp.ClientSession, url: str, n: int, concurrency: int) -> list[float]:
    out: list[float] = []

    async def worker(k: int) -> None:
        for _ in range(k):
            out.append(await _one(http, url))

    share, extra = divmod(n, concurrency)
    await asyncio.gather(*(worker(share + (i < extra)) for i in range(concurrency)))
    return out


async def compare(
    direct: str, routed: str, requests: int, concurrency: int, rounds: int = 10
) -> dict[str, list[float]]:
    """Latencies of `requests` calls to each URL, interleaved in `rounds` batches."""
    lat: dict[str, list[float]] = {"direct": [], "router": []}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:
        for url in (direct, routed):  # warm both paths
            await _batch(http, url + "/v1/chat/completions", 50, concurrency)
        per = max(1, requests // rounds)
        for _ in range(rounds):
            for name, url in (("direct", direct), ("router", routed)):
                lat[name] += await _batch(http, url + "/v1/chat/completions", per, concurrency)
    return lat


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(lat: dict[str, list[float]]) -> dict[str, float]:
    d, r = lat["direct"], lat["router"]
    return {
        "direct_p50_ms": percentile(d, 0.5) * 1e3,
        "router_p50_ms": percentile(r, 0.5) * 1e3,
        "added_p50_ms": (percentile(r, 0.5) - percentile(d, 0.5)) * 1e3,
        "direct_p99_ms": percentile(d, 0.99) * 1e3,
        "router_p99_ms": percentile(r, 0.99) * 1e3,
        "added_p99_ms": (percentile(r, 0.99) - percentile(d, 0.99)) * 1e3,
        "ratio_p50": statistics.median(r) / statistics.median(d),
    }


def parser_for(doc: str, concurrency: int) -> argparse.ArgumentParser:
    """The flags every overhead benchmark takes."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="per path and mode")
    parser.add_argument("--concurrency", type=int, default=concurrency)
    parser.add_argument(
        "--strategy", default=DEFAULT_STRATEGY, help=f"router strategy (default {DEFAULT_STRATEGY})"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = parser_for(__doc__, 64)
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="router processes (default 0: one per core, as kvroute serve starts)",
    )
    args = parser.parse_args(argv)
    results = {}
    with backend_and_router(args.strategy, args.workers) as (direct, routed):
        for label, conc in (
            ("sequential", 1),
            (f"concurrency {args.concurrency}", args.concurrency),
        ):
            lat = asyncio.run(compare(direct, routed, args.requests, conc))
            results[label] = summarize(lat)
    cpus = os.cpu_count()
    print(
        f"router overhead, {args.strategy}, {args.workers} workers, "
        f"{args.requests} requests per path, cpus={cpus}"
    )
    print(
        f"{'mode':18} {'direct p50':>11} {'router p50':>11} {'added p50':>10} "
        f"{'direct p99':>11} {'router p99':>11} {'added p99':>10}"
    )
    for label, s in results.items():
        print(
            f"{label:18} {s['direct_p50_ms']:9.3f}ms {s['router_p50_ms']:9.3f}ms "
            f"{s['added_p50_ms']:8.3f}ms {s['direct_p99_ms']:9.3f}ms "
            f"{s['router_p99_ms']:9.3f}ms {s['added_p99_ms']:8.3f}ms"
        )
    if args.json:
        write_json(args.json, results)
    return 0


def write_json(path: str, results: dict) -> None:
    with open(path, "wb") as f:
        f.write(orjson.dumps(results, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    sys.exit(main())
