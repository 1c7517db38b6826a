"""What a /metrics scrape costs a router with several workers, as the fleet grows.

Every worker exports ~140 series per backend (the request counters of its statuses and
endpoints, and the TTFT / inter-token / E2E histograms of two endpoints), and any worker
may answer a scrape with every process's series summed (merged by the collector, which
primes them, since e711926; by the answering worker before). This starts a router
(`kvroute serve`, KV_AWARE, `--workers`) in front of `--backends` ports of one instant
backend (`bench.studies.instant_backend --sites`), sends small requests on new
connections until every worker has answered some, and then:

- scrapes /metrics `--scrapes` times, each on a new connection (so that the scrapes
  fall on every worker), one at a time: the first scrape of each worker (the first merge
  primes every backend's series and reads every file) and the rest;
- sends small chat requests one at a time, first alone and then while a scraper scrapes
  back to back: their P99 both ways, the difference being what a scrape holds a worker's
  event loop;
- sums each process's PSS growth from before the requests (prometheus-client objects,
  the merged page's state).

Reproduces docs/performance.md, "/metrics at a thousand backends".

    python -m bench.studies.metrics_scrape                       # 1,024 backends, 2 workers
    python -m bench.studies.metrics_scrape --backends 64 --workers 4
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import msgspec

from bench.harness.processes import free_port, kvroute_serve, process, wait_routable
from bench.studies.index_memory import memory, rollups
from bench.studies.long_prompts import _SMALL, _send
from bench.studies.overhead import percentile


class Result(msgspec.Struct, frozen=True):
    backends: int
    workers: int
    series: int
    page_bytes: int
    first_scrapes_s: list[float]
    later_scrape_p50_s: float
    later_scrape_max_s: float
    small_p99_alone_ms: float
    small_p99_scraped_ms: float
    scrapes_meanwhile: int
    pss_growth_mib: float


async def _scrape(url: str) -> tuple[float, bytes]:
    """One scrape on a connection of its own: (seconds, page)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        start = time.perf_counter()
        async with http.get(url + "/metrics") as resp:
            page = await resp.read()
        return time.perf_counter() - start, page


async def _scraper(url: str, stop: asyncio.Event) -> int:
    done = 0
    while not stop.is_set():
        await _scrape(url)
        done += 1
    return done


async def run(url: str, scrapes: int, small: int) -> tuple[list, bytes, list, list, int]:
    """(scrape seconds in order, the last page, small-request seconds alone, and while
    scraped, scrapes meanwhile)."""
    times, page = [], b""
    for _ in range(scrapes):
        seconds, page = await _scrape(url)
        times.append(seconds)
    async with aiohttp.ClientSession() as http:
        for _ in range(20):
            await _send(http, url, _SMALL)
        alone = [await _send(http, url, _SMALL) for _ in range(small)]
        stop = asyncio.Event()
        scraper = asyncio.create_task(_scraper(url, stop))
        scraped = [await _send(http, url, _SMALL) for _ in range(small)]
        stop.set()
        meanwhile = await scraper
    return times, page, alone, scraped, meanwhile


async def _warm(url: str, workers: int) -> None:
    """Small requests on new connections, enough that every worker answers some."""
    for _ in range(20 * workers):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as h:
            await _send(h, url, _SMALL)


def measure(args: argparse.Namespace) -> Result:
    backend = [sys.executable, "-m", "bench.studies.instant_backend", "--sites", str(args.backends)]
    with tempfile.TemporaryDirectory() as tmp, process(backend) as instant:
        urls = [instant.stdout.readline().strip() for _ in range(args.backends)]
        backends = [{"url": u, "name": f"b{i}"} for i, u in enumerate(urls)]
        config = {"backends": backends, "routing": {"strategy": "KV_AWARE"}}
        config |= {"workers": args.workers, "access_log": {"enabled": False}}
        cmd = kvroute_serve(config, Path(tmp) / "router.json")
        port = free_port()
        serve = [*cmd, "--port", str(port), "--log-level", "warning"]
        with process(serve, stdout=subprocess.DEVNULL) as proc:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(wait_routable(url, proc))
            before, _, _ = memory(rollups(proc.pid))
            asyncio.run(_warm(url, args.workers))
            times, page, alone, scraped, meanwhile = asyncio.run(run(url, args.scrapes, args.small))
            after, _, _ = memory(rollups(proc.pid))
    firsts, later = times[: args.workers], times[args.workers :] or times
    series = sum(1 for line in page.splitlines() if line and not line.startswith(b"#"))
    return Result(
        backends=args.backends,
        workers=args.workers,
        series=series,
        page_bytes=len(page),
        first_scrapes_s=firsts,
        later_scrape_p50_s=statistics.median(later),
        later_scrape_max_s=max(later),
        small_p99_alone_ms=percentile(alone, 0.99) * 1e3,
        small_p99_scraped_ms=percentile(scraped, 0.99) * 1e3,
        scrapes_meanwhile=meanwhile,
        pss_growth_mib=(after - before) / 2**20,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--scrapes", type=int, default=12, help="one at a time")
    parser.add_argument("--small", type=int, default=400, help="small requests, each way")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = parser.parse_args(argv)
    r = measure(args)
    print(
        f"{r.backends} backends, {r.workers} workers: {r.series:,} series, "
        f"{r.page_bytes / 2**20:.1f} MiB a page\n"
        f"first scrapes (s): {', '.join(f'{s:.2f}' for s in r.first_scrapes_s)}; "
        f"later P50 {r.later_scrape_p50_s:.3f} s, max {r.later_scrape_max_s:.3f} s\n"
        f"small-request P99 {r.small_p99_alone_ms:.2f} ms alone, "
        f"{r.small_p99_scraped_ms:.2f} ms while scraped back to back "
        f"({r.scrapes_meanwhile} scrapes meanwhile)\n"
        f"PSS growth of the router's processes: {r.pss_growth_mib:,.0f} MiB"
    )
    if args.json:
        Path(args.json).write_bytes(msgspec.json.encode(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
