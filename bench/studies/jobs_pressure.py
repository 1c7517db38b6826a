"""`python -m bench.studies.jobs_pressure`: what hostile job traffic costs one router worker.

`kvroute serve` with one worker, `jobs` on and a body budget of `--budget-mib`, in front
of one simulated backend. A probe process keeps a chat completion streaming through it
and stamps every event. Then, in turn:

- batch: a `--batch-mib` MiB input file of bad lines (`x`) is uploaded and a batch
  created from it (a check that fails, as a hostile client would make it);
- uploads: `--uploads` concurrent uploads of `--upload-mb` MB each;
- downloads: `--downloads` concurrent downloads of one of those uploads (an answer is
  its status if every byte came, else 0).

One row each: the probe's largest gap between two events before (baseline) and during
the step, how much larger it got (the stall), the worker's RSS before and at its peak
(sampled with psutil every 10 ms), the worst lag the router saw on its own event loop
(its `kvroute_event_loop_lag_seconds` histogram, as a bucket's bound: the probe's gaps
also take in the simulator's and the probe's own scheduling), and the answers. The
probe runs in a process of its own, so the bench's own uploads never delay its clock.

No section of docs/performance.md quotes it yet: a study of what job uploads,
downloads and batches cost a worker's interactive streams (tests/bench/test_jobs_pressure.py
runs it small).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import aiohttp
import msgspec
import psutil

from bench.harness.processes import kvroute_serve, replicas, simulator
from bench.harness.routed import MODEL

_MIB = 1 << 20


class Step(msgspec.Struct, frozen=True):
    name: str
    baseline_gap_ms: float
    gap_ms: float
    stall_ms: float
    rss_before_mb: float
    rss_peak_mb: float
    #: the router's own look at its loop: the worst lateness of its 4-a-second timer
    #: during the step, as the upper bound of its histogram bucket
    loop_lag_ms: float
    answers: list[int]
    took_s: float


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.studies.jobs_pressure", description=__doc__.split("\n")[0]
    )
    p.add_argument("--budget-mib", type=int, default=256, help="limits.max_buffered_body_bytes")
    p.add_argument("--batch-mib", type=int, default=64, help="the bad batch file, MiB")
    p.add_argument("--uploads", type=int, default=8, help="concurrent uploads")
    p.add_argument("--upload-mb", type=int, default=60, help="each upload, MB")
    p.add_argument("--downloads", type=int, default=8, help="concurrent downloads of an upload")
    p.add_argument("--time-scale", type=float, default=0.25, help="simulated durations x this")
    p.add_argument("--out", type=Path, metavar="FILE", help="write the steps as JSON")
    return p


def _probe(url: str, stop: multiprocessing.synchronize.Event, stamps: multiprocessing.Queue):
    """In its own process: stream completions one after another, stamping each event."""

    async def run() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}]}
        body |= {"max_tokens": 4000, "stream": True}
        seen: list[float] = []
        async with aiohttp.ClientSession() as http:
            while not stop.is_set():
                async with http.post(url + "/v1/chat/completions", json=body) as r:
                    async for _ in r.content:
                        seen.append(time.time())
                        if stop.is_set():
                            break
        stamps.put(seen)

    asyncio.run(run())


class _Rss:
    """The peak RSS of the largest process under `pid`, sampled in a thread."""

    def __init__(self, pid: int) -> None:
        self._root = psutil.Process(pid)
        self.peak = 0.0
        self._on = False
        self._thread: threading.Thread | None = None

    def now(self) -> float:
        procs = [self._root, *self._root.children(recursive=True)]
        return max(p.memory_info().rss for p in procs) / 1e6

    def __enter__(self) -> _Rss:
        self.peak, self._on = self.now(), True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._on:
            self.peak = max(self.peak, self.now())
            time.sleep(0.01)

    def __exit__(self, *_: object) -> None:
        self._on = False
        if self._thread is not None:
            self._thread.join()


async def _lag_buckets(http: aiohttp.ClientSession, url: str) -> dict[float, float]:
    """The router's event-loop lag histogram: count at or under each bound, seconds."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    found = {}
    for line in text.splitlines():
        if line.startswith("kvroute_event_loop_lag_seconds_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            found[float(bound)] = float(line.rsplit(" ", 1)[1])
    return found


def _worst_lag(before: dict[float, float], after: dict[float, float]) -> float:
    """The smallest bound that holds every lag observed between two scrapes, ms."""
    total = after[float("inf")] - before[float("inf")]
    return 1000 * min(b for b in after if after[b] - before[b] >= total)


def _max_gap(stamps: list[float], start: float, end: float) -> float:
    """The largest gap between two events, counting those whose gap ends within it."""
    gaps = [b - a for a, b in itertools.pairwise(stamps) if start <= b <= end + 1]
    return max(gaps, default=0.0) * 1000


async def _bad_batch(http: aiohttp.ClientSession, url: str, mib: int) -> list[int]:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", b"x\n" * (mib * _MIB // 2), filename="bad.jsonl")
    async with http.post(url + "/v1/files", data=form) as r:
        answers = [r.status]
        file_id = (await r.json()).get("id")
    asked = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    async with http.post(url + "/v1/batches", json={**asked, "completion_window": "24h"}) as r:
        answers.append(r.status)
    return answers


async def _uploads(
    http: aiohttp.ClientSession, url: str, n: int, mb: int, kept: list[str]
) -> list[int]:
    """The uploads' answers; the files' ids go to `kept`."""
    content = b"y" * (mb * 1_000_000)

    async def one(i: int) -> int:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", content, filename=f"u{i}.jsonl")
        async with http.post(url + "/v1/files", data=form) as r:
            if r.status == 200:
                kept.append((await r.json())["id"])
            return r.status

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def _downloads(
    http: aiohttp.ClientSession, url: str, n: int, mb: int, kept: list[str]
) -> list[int]:
    """`n` downloads at once of the first upload kept, read as they come."""

    async def one() -> int:
        async with http.get(f"{url}/v1/files/{kept[0]}/content") as r:
            size = 0
            async for chunk in r.content.iter_any():
                size += len(chunk)
            return r.status if size == mb * 1_000_000 else 0

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvroute-pressure-") as tmp:
        async with simulator(1, args.time_scale, []) as (backends, _):
            jobs = {"enabled": True, "path": str(Path(tmp) / "jobs.db")}
            config = {
                "backends": backends, "workers": 1, "jobs": jobs, "log_level": "warning",
                "limits": {"max_buffered_body_bytes": args.budget_mib * _MIB},
            }  # fmt: skip

            def command(port: int) -> list[str]:
                listen = {"listen": {"host": "127.0.0.1", "port": port}}
                return kvroute_serve({**config, **listen}, Path(tmp) / "router.json")

            async with replicas(command, "/ready", 1) as [(url, pid)]:
                steps = await _steps(args, url, pid)
    print(f"{'step':<9} {'gap before':>10} {'gap during':>10} {'stall':>8} "
          f"{'RSS before':>10} {'RSS peak':>9} {'loop lag':>9}  answers")  # fmt: skip
    for s in steps:
        print(
            f"{s.name:<9} {s.baseline_gap_ms:>8.1f}ms {s.gap_ms:>8.1f}ms {s.stall_ms:>6.1f}ms "
            f"{s.rss_before_mb:>8.0f}MB {s.rss_peak_mb:>7.0f}MB <={s.loop_lag_ms:>5.0f}ms  "
            f"{s.answers} in {s.took_s:.1f}s"
        )
    if args.out is not None:
        args.out.write_bytes(msgspec.json.encode({"steps": steps, "argv": sys.argv[1:]}))
    return 0


async def _steps(args: argparse.Namespace, url: str, pid: int) -> list[Step]:
    ctx = multiprocessing.get_context("spawn")
    stop, stamps = ctx.Event(), ctx.Queue()
    probe = ctx.Process(target=_probe, args=(url, stop, stamps), daemon=True)
    probe.start()
    windows: list[tuple[str, float, float, float, float, float, list[int]]] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            await asyncio.sleep(3)  # the probe streaming: the baseline
            kept: list[str] = []
            mb = args.upload_mb
            actions: list[tuple[str, Callable[[], Awaitable[list[int]]]]] = [
                ("batch", lambda: _bad_batch(http, url, args.batch_mib)),
                ("uploads", lambda: _uploads(http, url, args.uploads, mb, kept)),
                ("downloads", lambda: _downloads(http, url, args.downloads, mb, kept)),
            ]
            for name, action in actions:
                lags = await _lag_buckets(http, url)
                with _Rss(pid) as rss:
                    before, start = rss.now(), time.time()
                    answers = await action()
                    end = time.time()
                lag = _worst_lag(lags, await _lag_buckets(http, url))
                windows.append((name, start, end, before, rss.peak, lag, answers))
                await asyncio.sleep(2)
    finally:
        stop.set()
        seen: list[float] = stamps.get(timeout=60)
        probe.join(10)
    first = windows[0][1]
    baseline = _max_gap(seen, seen[0] + 0.5, first - 1)
    return [
        Step(
            name,
            baseline,
            (gap := _max_gap(seen, start, end)),
            max(0.0, gap - baseline),
            before,
            peak,
            lag,
            answers,
            end - start,
        )
        for name, start, end, before, peak, lag, answers in windows
    ]


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
