"""What the prefix index takes of a router host's memory, at 1, 2 and 4 workers.

A router (`kvroute serve`, KV_AWARE, no KV events: approximate mode) in front of
`--backends` ports of one instant backend (`bench.studies.instant_backend --sites`) learns where
`--requests` new prompts of `--words` words went: each one's block keys (up to
`max_prefix_tokens` worth) become speculative entries of the backend it chose (each
backend's /metrics shows a KV cache with room for every prompt, so the index, which keeps
no more of a backend's blocks than its cache holds, keeps them all). The
host's memory is measured before and after, over the supervisor and every child: the
sum of their PSS (a page several processes map counts once, split between them: what
the host really gives them; `memory` of psutil, from /proc/PID/smaps_rollup) and of
their RSS (each process's resident pages, a shared page counted in each), both from
/proc/PID/smaps_rollup; and each process's own growth (its anonymous memory: its heap,
not the shared files), by its title, to tell the collector's from a worker's.

With the index in one file of the run directory that every process maps, the PSS
growth is one table's, whatever the worker count; with a copy per process (a run
directory without room to share it, or a tree before the shared table), it is one per
process holding an index (each worker and the collector).

Reproduces docs/performance.md, "Index memory per host".

    python -m bench.studies.index_memory                          # 64 backends, 1,000 prompts
    python -m bench.studies.index_memory --backends 1024 --requests 16000   # 500k tokens each
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import msgspec

from bench.harness import procstat
from bench.harness.processes import free_port, kvroute_serve, process, wait_routable
from bench.studies.long_prompts import chat_body
from router.config import APPROXIMATE_BLOCK_SIZE

_CHAT = "/v1/chat/completions"
_HEADERS = {"Content-Type": "application/json"}
#: (key, backend) entries of a fleet of 1,024 backends holding 500k tokens each, in the
#: blocks of the router measured (KV_AWARE without KV events: its own 64-token blocks)
FULL_FLEET = 1024 * 500_000 // APPROXIMATE_BLOCK_SIZE


class Row(msgspec.Struct, frozen=True):
    """One router's growth over the fill, in bytes (`entries`: (key, backend) pairs)."""

    workers: int
    processes: int
    entries: int
    pss_bytes: int
    rss_bytes: int
    gauge_bytes: int
    shared_files_bytes: int
    seconds: float
    #: each process's anonymous memory growth, by its title ("kvroute: worker 0", ...)
    by_process: dict[str, int] = {}

    @property
    def per_entry(self) -> float:
        return self.pss_bytes / max(1, self.entries)


def rollups(root: int) -> dict[str, dict[str, int]]:
    """Each process of `root`'s tree, by its title (`kvroute: collector`, `kvroute: worker
    N`, ...; another, multiprocessing's resource tracker, as "pid N"): its PSS, RSS and
    anonymous memory in bytes, from /proc/PID/smaps_rollup."""
    out = {}
    for pid in procstat.tree(root):
        with contextlib.suppress(OSError):
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
            name = title.decode() if title.startswith(b"kvroute: ") else f"pid {pid}"
            kb = re.findall(r"^(Pss|Rss|Anonymous):\s+(\d+) kB", rollup, re.M)
            out[name] = {field: int(n) * 1024 for field, n in kb}
    return out


def memory(processes: dict[str, dict[str, int]]) -> tuple[int, int, int]:
    """(PSS, RSS, processes) summed over `rollups`' `processes`, in bytes."""
    pss = sum(p["Pss"] for p in processes.values())
    return pss, sum(p["Rss"] for p in processes.values()), len(processes)


def allocated(rundirs: Path) -> int:
    """Bytes the run directories' index files hold (their sparse arenas' live pages)."""
    return sum(p.stat().st_blocks * 512 for p in rundirs.glob("kvroute-*/index-*"))


async def _status(http: aiohttp.ClientSession, url: str) -> tuple[int, int]:
    """(entries the index holds, its gauge's bytes) as the router shows them."""
    async with http.get(url + "/debug/routing") as resp:
        state = await resp.json()
    entries = sum(sum(b.get("index_keys") or (0, 0)) for b in state["backends"].values())
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    gauge = sum(
        float(m.group(1)) for m in re.finditer(r"kvroute_prefix_index_bytes\{[^}]*\} (\S+)", text)
    )
    return entries, int(gauge)


async def fill(url: str, words: int, requests: int, concurrency: int) -> tuple[int, int]:
    """Send `requests` new prompts, `concurrency` at a time; then wait until the index
    stops growing (the workers apply each other's placements, the gauge shows once a
    second); (entries, gauge bytes)."""
    todo = iter(range(requests))

    async def sender(http: aiohttp.ClientSession) -> None:
        for i in todo:
            async with http.post(url + _CHAT, data=chat_body(words, i), headers=_HEADERS) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url} answered {resp.status}")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(sender(http) for _ in range(concurrency)))
        seen, deadline = (-1, -1), time.monotonic() + 30
        while time.monotonic() < deadline:
            now = await _status(http, url)
            if now == seen and now[1] > 0:
                break
            seen = now
            await asyncio.sleep(1.5)
        return seen


def measure(urls: list[str], args: argparse.Namespace, workers: int, workdir: Path) -> Row:
    """One router at `workers` workers, filled from empty."""
    runs = Path(tempfile.mkdtemp(prefix="index-memory-", dir=_tmpfs(workdir)))
    backends = [{"url": url, "name": f"b{i}"} for i, url in enumerate(urls)]
    config = {"backends": backends, "routing": {"strategy": "KV_AWARE"}, "workers": workers}
    config |= {"access_log": {"enabled": False}}
    cmd = kvroute_serve(config, workdir / f"router-{workers}.json")
    port = free_port()
    env = {**os.environ, "KVROUTE_RUN_PARENT": str(runs)}
    serve = [*cmd, "--port", str(port), "--log-level", "warning"]
    with process(serve, stdout=subprocess.DEVNULL, env=env) as proc:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_routable(url, proc))
        before = rollups(proc.pid)
        pss0, rss0, _ = memory(before)
        t0 = time.perf_counter()
        entries, gauge = asyncio.run(fill(url, args.words, args.requests, args.concurrency))
        seconds = time.perf_counter() - t0
        after = rollups(proc.pid)
        pss1, rss1, count = memory(after)
        grown = {
            name: p["Anonymous"] - before.get(name, {}).get("Anonymous", 0)
            for name, p in after.items()
        }
        files = allocated(runs)
    shutil.rmtree(runs, ignore_errors=True)
    growth = (pss1 - pss0, rss1 - rss0, gauge, files, seconds)
    return Row(workers, count, entries, *growth, by_process=dict(sorted(grown.items())))


def _tmpfs(workdir: Path) -> Path:
    """Where the router's run directory goes: /dev/shm, as `kvroute serve` puts it (its
    pages are memory there, not a disk file's cache), else `workdir`."""
    shm = Path("/dev/shm")
    return shm if os.access(shm, os.W_OK) else workdir


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def table(rows: Sequence[Row]) -> list[str]:
    lines = [
        "| workers | processes | entries | PSS growth (MiB) | RSS growth, summed (MiB) "
        "| gauge (MiB) | index files (MiB) | bytes / entry (PSS) | 1,024 x 500k tokens (GiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.workers} | {r.processes} | {r.entries:,} | {_mib(r.pss_bytes)} "
            f"| {_mib(r.rss_bytes)} | {_mib(r.gauge_bytes)} | {_mib(r.shared_files_bytes)} "
            f"| {r.per_entry:.0f} | {r.per_entry * FULL_FLEET / 2**30:.2f} |"
        )
    return lines


def per_process(rows: Sequence[Row]) -> list[str]:
    """Each row's processes and their own growth, the collector's apart from the workers'."""
    head = "worker(s), anonymous memory growth by process (MiB):"
    return [f"{r.workers} {head} {_by_name(r.by_process)}" for r in rows]


def _by_name(grown: dict[str, int]) -> str:
    return ", ".join(f"{name.removeprefix('kvroute: ')} {_mib(n)}" for name, n in grown.items())


def kv_tokens(requests: int, words: int) -> int:
    """The KV cache each backend shows: room for every prompt, were they all sent to it
    (~1.6 tokens a word; 2 to spare). The router keeps no more of a backend's blocks in
    its index than its cache holds, and a smaller cache would make the entries, and so
    the memory measured, depend on how evenly the prompts spread."""
    return requests * words * 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", type=int, default=64, help="backend names (default 64)")
    parser.add_argument("--requests", type=int, default=1000, help="new prompts (default 1000)")
    parser.add_argument(
        "--words", type=int, default=20_000, help="per prompt (default 20,000: 512 64-token blocks)"
    )
    parser.add_argument("--workers", default="1,2,4", help="worker counts (default 1,2,4)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    rows = []
    backend = [sys.executable, "-m", "bench.studies.instant_backend", "--sites", str(args.backends)]
    backend += ["--kv-tokens", str(kv_tokens(args.requests, args.words))]
    with tempfile.TemporaryDirectory() as tmp, process(backend) as instant:
        urls = [instant.stdout.readline().strip() for _ in range(args.backends)]
        for workers in (int(w) for w in args.workers.split(",")):
            rows.append(measure(urls, args, workers, Path(tmp)))
            print(table(rows)[-1], file=sys.stderr, flush=True)
    print("\n".join(table(rows)))
    print("\n".join(per_process(rows)))
    if args.json:
        Path(args.json).write_bytes(msgspec.json.encode(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
