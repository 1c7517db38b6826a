"""Added latency of the router over calling the backend directly, in the same run.

An instant backend (`bench.studies.instant_backend`) and a router in front of it run as separate
processes; one client alternates batches of direct and routed requests so both see the
same machine noise, sequentially and at a fixed concurrency. The figure that matters is
the difference of the two distributions (router - direct), not either alone.

    python -m bench.studies.overhead --requests 2000 --concurrency 64

The router runs as `kvroute serve` starts by default (its strategy, a worker per core,
the access log on, here into a file); `--strategy` and `--workers` measure others.
`--access-log-off` adds a router with the access log off, `--tracing-unsampled` one
with tracing configured but sampling nothing, and `--capture SHARE` one with data capture
sampling that share (repeatable), in the same batches; `--stream N` sends streams of N
events instead of whole answers: the difference of their added
latencies from the default router's is what the log, tracing or capture costs.

Reproduces docs/performance.md, "What the access log and tracing cost" and "What data
capture costs", and the added latency under "Routing quality on the simulator";
bench.studies.throughput times its latencies with `compare`, grpc_overhead shares its flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import aiohttp
import orjson

from bench.harness.processes import JSON_HEADERS, PING_BODY, free_port, process, wait_ready
from router.config import DEFAULT_STRATEGY


def _capturing(name: str, path: str) -> dict:
    """The settings of a CAPTURING variant, its files under `path`."""
    share = float(name.rsplit(" ", 1)[1])
    return {"capture": {"enabled": True, "sample": share, "path": path}}


#: the routers a run can compare, by name: their settings beside the defaults
VARIANTS: dict[str, dict] = {
    "router": {},
    "router, no access log": {"access_log": {"enabled": False}},
    "router, tracing not sampled": {"tracing": {"enabled": True, "sample_ratio": 0.0}},
}
#: a router with data capture on, sampling this share (`--capture`)
CAPTURING = "router, capturing {share:g}"


@contextlib.contextmanager
def backend_and_routers(
    strategy: str, workers: int = 1, variants: tuple[str, ...] = ("router",)
) -> Iterator[tuple[str, list[str]]]:
    """Start the instant backend and a router in front of it per name in `variants`
    (VARIANTS: the access log on, into a file, unless the variant turns it off); yield
    the backend's URL and theirs."""
    py = sys.executable
    with (
        process([py, "-m", "bench.studies.instant_backend", "--port", "0"]) as backend,
        tempfile.TemporaryDirectory() as tmp,
        contextlib.ExitStack() as routers,
    ):
        backend_url = backend.stdout.readline().strip()
        urls = []
        for i, name in enumerate(variants):
            config = os.path.join(tmp, f"router-{i}.yaml")
            settings = {"access_log": {"path": os.path.join(tmp, f"access-{i}.log")}}
            if name in VARIANTS:
                variant = VARIANTS[name]
            else:
                variant = _capturing(name, os.path.join(tmp, f"capture-{i}"))
            with open(config, "wb") as f:
                f.write(orjson.dumps({**settings, **variant}))  # JSON is YAML
            port = free_port()
            cmd = [py, "-m", "router", "serve", "-c", config, "--port", str(port)]
            cmd += ["--backend", backend_url, "--workers", str(workers)]
            cmd += ["--strategy", strategy, "--log-level", "warning"]
            routers.enter_context(process(cmd, subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            asyncio.run(wait_ready(url))
        yield backend_url, urls


def body(events: int = 0) -> bytes:
    """The request every path is sent: one whole answer, or a stream of `events`."""
    if not events:
        return PING_BODY
    return orjson.dumps({**orjson.loads(PING_BODY), "stream": True, "max_tokens": events})


async def _one(http: aiohttp.ClientSession, url: str, data: bytes = PING_BODY) -> float:
    t0 = time.perf_counter()
    async with http.post(url, data=data, headers=JSON_HEADERS) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}")
    return time.perf_counter() - t0


async def _batch(
    http: aiohttp.ClientSession, url: str, n: int, concurrency: int, data: bytes = PING_BODY
) -> list[float]:
    out: list[float] = []

    async def worker(k: int) -> None:
        for _ in range(k):
            out.append(await _one(http, url, data))

    share, extra = divmod(n, concurrency)
    await asyncio.gather(*(worker(share + (i < extra)) for i in range(concurrency)))
    return out


async def compare(
    urls: dict[str, str], requests: int, concurrency: int, rounds: int = 10, data: bytes = PING_BODY
) -> dict[str, list[float]]:
    """Latencies of `requests` calls (of `data`) to each named URL, interleaved in
    `rounds` batches."""
    lat: dict[str, list[float]] = {name: [] for name in urls}
    conn = aiohttp.TCPConnector(limit=0)
    path = "/v1/chat/completions"
    async with aiohttp.ClientSession(connector=conn) as http:
        for url in urls.values():  # warm every path
            await _batch(http, url + path, 50, concurrency, data)
        per = max(1, requests // rounds)
        for _ in range(rounds):
            for name, url in urls.items():
                lat[name] += await _batch(http, url + path, per, concurrency, data)
    return lat


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(lat: dict[str, list[float]], router: str = "router") -> dict[str, float]:
    """`router`'s latencies against the direct ones'."""
    d, r = lat["direct"], lat[router]
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
    parser.add_argument(
        "--access-log-off",
        action="store_true",
        help="also measure a router with the access log off, in the same batches",
    )
    parser.add_argument(
        "--tracing-unsampled",
        action="store_true",
        help="also measure a router with tracing on and sample_ratio 0, in the same batches",
    )
    parser.add_argument(
        "--capture",
        type=float,
        action="append",
        default=[],
        metavar="SHARE",
        help="also measure a router with data capture sampling SHARE of the requests (1: "
        "every one), in the same batches; repeatable",
    )
    parser.add_argument(
        "--stream",
        type=int,
        default=0,
        metavar="EVENTS",
        help="streamed answers of EVENTS events instead of whole ones (latency to the end)",
    )
    args = parser.parse_args(argv)
    names = ("router",)
    names += ("router, no access log",) if args.access_log_off else ()
    names += ("router, tracing not sampled",) if args.tracing_unsampled else ()
    names += tuple(CAPTURING.format(share=share) for share in args.capture)
    results = {}
    with backend_and_routers(args.strategy, args.workers, names) as (direct, routed):
        urls = {"direct": direct, **dict(zip(names, routed, strict=True))}
        for mode, conc in (
            ("sequential", 1),
            (f"concurrency {args.concurrency}", args.concurrency),
        ):
            lat = asyncio.run(compare(urls, args.requests, conc, data=body(args.stream)))
            for name in names:
                results[f"{mode}, {name}" if len(names) > 1 else mode] = summarize(lat, name)
    cpus = os.cpu_count()
    answers = f"streams of {args.stream} events" if args.stream else "whole answers"
    print(
        f"router overhead, {args.strategy}, {args.workers} workers, access log into a file, "
        f"{args.requests} requests per path, {answers}, cpus={cpus}"
    )
    width = max(map(len, results)) + 1
    print(
        f"{'mode':{width}} {'direct p50':>11} {'router p50':>11} {'added p50':>10} "
        f"{'direct p99':>11} {'router p99':>11} {'added p99':>10}"
    )
    for label, r in results.items():
        print(
            f"{label:{width}} {r['direct_p50_ms']:9.3f}ms {r['router_p50_ms']:9.3f}ms "
            f"{r['added_p50_ms']:8.3f}ms {r['direct_p99_ms']:9.3f}ms "
            f"{r['router_p99_ms']:9.3f}ms {r['added_p99_ms']:8.3f}ms"
        )
    if args.json:
        write_json(args.json, results)
    return 0


def write_json(path: str, results: dict) -> None:
    with open(path, "wb") as f:
        f.write(orjson.dumps(results, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    sys.exit(main())
