"""A fleet at rest: the CPU a router spends watching N backends while no request comes.

A router scrapes every backend's /metrics, probes its health and (with several workers)
feeds what it learns to every worker, whether or not requests flow: at a thousand
backends that is the floor of its CPU. For each `--backends` count this starts one
instant backend with that many ports (`bench.studies.instant_backend --raw --sites`,
each answering /metrics with a vLLM page, /health and /v1/models) and `kvroute serve`
in front of them as users start it (KV_AWARE, default workers, scrapes every second),
waits until a worker shows every backend scraped, then reads each process's CPU from
/proc for `--seconds`: the collector's, the workers' together, the whole router's, and
that total per backend. `--peers` adds sglang-router's and vllm-router's cache_aware
routers in front of the same ports, measured once their /workers lists every backend
(they scrape nothing: their floor is their health checks).

Reproduces docs/performance.md, "A fleet at rest".

    python -m bench.studies.fleet_upkeep --backends 64,256,1024
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import aiohttp
import msgspec

from bench.harness import procstat
from bench.harness.peers import PEERS_VENV, find_peers, peer_cmd
from bench.harness.processes import (
    free_port,
    kvroute_serve,
    logged,
    on_port,
    process,
    wait_routable,
)

_WATCHING_WAIT_S = 120.0
_POLL_S = 0.5


class Row(msgspec.Struct, frozen=True):
    """One router in front of `backends` idle backends: CPU in ms per second."""

    router: str
    backends: int
    collector_ms: float
    workers_ms: float
    total_ms: float

    @property
    def per_backend_us(self) -> float:
        return self.total_ms * 1e3 / self.backends


async def _watching_all(url: str, backends: int, alive: Callable[[], bool], peer: bool) -> None:
    """Until the router shows every backend watched: scraped, in a worker's
    /debug/routing (kvroute), or registered, in its /workers (a peer registers its
    workers for a while after it first routes: ~20 s of a core for sglang-router at
    1,024)."""
    deadline = time.monotonic() + _WATCHING_WAIT_S
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline and alive():
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url + ("/workers" if peer else "/debug/routing")) as resp:
                    state = await resp.json(content_type=None)
                if peer:
                    watched = len(state["workers"])
                else:
                    watched = sum(1 for b in state["backends"].values() if b.get("scraped"))
                if watched == backends:
                    return
            await asyncio.sleep(_POLL_S)
    raise RuntimeError(f"{url}: not every backend watched within {_WATCHING_WAIT_S:.0f} s")


def _by_role(root: int) -> dict[str, list[int]]:
    """The router's processes: the collector apart from the rest (workers, supervisor)."""
    groups: dict[str, list[int]] = {"collector": [], "workers": []}
    for pid in procstat.tree(root):
        with contextlib.suppress(OSError):
            collector = b"kvroute: collector" in Path(f"/proc/{pid}/cmdline").read_bytes()
            groups["collector" if collector else "workers"].append(pid)
    return groups


def _measured(name: str, root: int, backends: int, seconds: float) -> Row:
    groups = _by_role(root)
    with procstat.cpu_meter(groups | {"total": procstat.tree(root)}) as cpu:
        time.sleep(seconds)
    ms = {k: v * 1e3 for k, v in cpu.items()}
    return Row(name, backends, ms.get("collector", 0.0), ms.get("workers", 0.0), ms["total"])


def measure(urls: list[str], args: argparse.Namespace, workdir: Path) -> list[Row]:
    """kvroute, then each peer, in front of `urls`, each measured at rest."""
    backends = [{"url": url, "name": f"b{i}"} for i, url in enumerate(urls)]
    config = {"backends": backends, "routing": {"strategy": "KV_AWARE"}}
    config |= {"workers": args.workers, "access_log": {"enabled": False}}
    starts = {"kvroute KV_AWARE": kvroute_serve(config, workdir / f"router-{len(urls)}.json")}
    for peer in find_peers(PEERS_VENV, install=True) if args.peers else ():
        if peer.policy == "cache_aware" and peer.python is not None:
            starts[peer.label] = peer_cmd(Path(peer.python), peer.package, urls, 0, peer.policy)
    rows = []
    for name, cmd in starts.items():
        port = free_port()
        cmd = on_port(cmd, port)
        with logged(cmd, workdir / f"{len(rows)}-{len(urls)}.out") as proc:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(wait_routable(url, proc, timeout=120))
            peer = not name.startswith("kvroute")
            asyncio.run(_watching_all(url, len(urls), lambda: proc.poll() is None, peer))
            rows.append(_measured(name, proc.pid, len(urls), args.seconds))
        print(table(rows)[-1], file=sys.stderr, flush=True)
    return rows


def table(rows: Sequence[Row]) -> list[str]:
    lines = [
        "| router | backends | collector (ms/s) | workers (ms/s) | whole router (ms/s) "
        "| per backend (µs/s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.router} | {r.backends:,} | {r.collector_ms:.0f} | {r.workers_ms:.0f} "
            f"| {r.total_ms:.0f} | {r.per_backend_us:.0f} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backends", default="64,256,1024", help="fleet sizes (default: %(default)s)"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="measured span (default 10)")
    parser.add_argument("--workers", type=int, default=0, help="0: one per core (default)")
    parser.add_argument("--peers", action="store_true", help="also sglang-router, vllm-router")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    for count in (int(n) for n in args.backends.split(",")):
        backend = [sys.executable, "-m", "bench.studies.instant_backend", "--raw", "--sites"]
        with tempfile.TemporaryDirectory() as tmp, process([*backend, str(count)]) as sites:
            urls = [sites.stdout.readline().strip() for _ in range(count)]
            rows += measure(urls, args, Path(tmp))
    print("\n".join(table(rows)))
    if args.json:
        Path(args.json).write_bytes(msgspec.json.encode(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
