"""What a long prompt costs the router: added latency and CPU per request, by prompt size.

Coding agents and RAG send prompts of tens of thousands of tokens, most of them new to
the router. This runs, against one instant backend (`bench.studies.instant_backend`, so every
millisecond added is the router's), for each router and each prompt size (in words, of
~6.5 characters as English has), `--requests` sequential chat requests:

- new: each with a system prompt the router has never seen (what costs it most: the
  chat rendering, the tokenizing and the block keys of the whole prompt);
- repeated: one prompt sent again and again (after one unmeasured send).

Each request is sent straight to the backend and then through every router in turn, so
all see the same bodies and the same machine noise. A cell is the router's added P50
(its P50 minus the direct P50) and its CPU per request (every process and thread of the
router, from /proc's nanosecond run times, background loops included).

Then the head-of-line probe: small requests, one at a time, through a kvroute worker
(`--workers 1`, so that they share its event loop with the long prompts), first alone
and then while new `--probe-tokens`-token prompts flow to the same worker back to back
(from a process of their own). What matters is the difference of the two P99s, beside
the same difference straight to the backend (here the raw one, `--raw`, which does not
parse bodies): what the machine's own contention adds. The process measured (the
worker, or the raw backend) has the first CPU to itself meanwhile and the load (the
probe's client, the sender, the backend) the others, the probe's client first in line
there (SCHED_FIFO, where allowed; `--no-pin`: all the scheduler's choice), so that the
difference is the loop's own waiting, not a core's time slices.

Reproduces docs/performance.md, "New long prompts".

    python -m bench.studies.long_prompts                  # kvroute KV_AWARE, default workers
    python -m bench.studies.long_prompts --peers          # and sglang-router, vllm-router
    python -m bench.studies.long_prompts --strategy all   # every kvroute strategy

`--peers` pip-installs the Rust routers into their own virtualenv on first use
(bench/peers.py) and compares their `cache_aware` policy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from pathlib import Path

import aiohttp
import msgspec
import orjson

import policies
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
from bench.harness.workloads import WorkloadSpec, tagged_text
from bench.studies.instant_backend import MODEL
from bench.studies.overhead import percentile
from router.config import DEFAULT_STRATEGY

SIZES = (1_000, 8_000, 32_000, 100_000)
MODES = ("new", "repeated")
#: characters per English word with its space, as 4-character tokens go (kvroute sim's)
_CHARS_PER_WORD = 6.5
_HEADERS = {"Content-Type": "application/json"}
_CHAT = "/v1/chat/completions"
_SMALL = orjson.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "ping " * 50}], "max_tokens": 1}
)
_SPEC = WorkloadSpec(shape="no-sharing", seed=37)


class Cell(msgspec.Struct, frozen=True):
    """One router at one size and mode: its added P50 and CPU per request, in ms."""

    router: str
    words: int
    mode: str
    added_p50_ms: float
    cpu_ms: float
    p50_ms: float
    direct_p50_ms: float


class Probe(msgspec.Struct, frozen=True):
    """Small requests' P99 through one worker, alone and beside new long prompts."""

    router: str
    quiet_p99_ms: float
    busy_p99_ms: float
    long_prompts: int

    @property
    def added_ms(self) -> float:
        return self.busy_p99_ms - self.quiet_p99_ms


def chat_body(words: int, index: int) -> bytes:
    """A chat request whose system prompt has about `words` words, unique to `index`."""
    tokens = max(2, round(words * _CHARS_PER_WORD / 4))
    system = tagged_text(_SPEC, "system", index, tokens)
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Summarize the document."},
    ]
    return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 1})


def cpu_ns(root: int) -> int:
    """CPU time of `root`, its threads and its descendants', in ns (/proc schedstat: the
    10 ms ticks of /proc/PID/stat cannot tell one request's cost)."""
    total = 0
    for pid in procstat.tree(root):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    total += int((task / "schedstat").read_text().split()[0])
    return total


async def _send(http: aiohttp.ClientSession, url: str, body: bytes) -> float:
    """Seconds until the whole answer is back; RuntimeError unless it is a 200."""
    t0 = time.perf_counter()
    async with http.post(url + _CHAT, data=body, headers=_HEADERS) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}")
    return time.perf_counter() - t0


async def measure(
    direct: str, routers: dict[str, tuple[str, int]], sizes: Sequence[int], requests: int
) -> list[Cell]:
    """Every router's cells; `routers`: name -> (URL, pid)."""
    cells: list[Cell] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for url in [direct, *(u for u, _ in routers.values())]:  # connect, warm
            for _ in range(5):
                await _send(http, url, _SMALL)
        index = 0
        for words in sizes:
            for mode in MODES:
                if mode == "new":
                    bodies = [chat_body(words, index + i) for i in range(requests)]
                    index += requests
                else:
                    bodies = [chat_body(words, index)] * requests
                    index += 1
                    for url, _ in routers.values():
                        await _send(http, url, bodies[0])
                cells += await _phase(http, direct, routers, bodies, words, mode)
    return cells


async def _phase(
    http: aiohttp.ClientSession,
    direct: str,
    routers: dict[str, tuple[str, int]],
    bodies: list[bytes],
    words: int,
    mode: str,
) -> list[Cell]:
    """Each body straight to the backend, then through each router in turn."""
    lat: dict[str, list[float]] = {name: [] for name in ["", *routers]}
    cpu = dict.fromkeys(routers, 0)
    for body in bodies:
        lat[""].append(await _send(http, direct, body))
        for name, (url, pid) in routers.items():
            before = cpu_ns(pid)
            lat[name].append(await _send(http, url, body))
            await asyncio.sleep(0.005)  # the router's work after its answer is its own
            cpu[name] += cpu_ns(pid) - before
    d50 = statistics.median(lat[""]) * 1e3
    return [
        Cell(
            router=name,
            words=words,
            mode=mode,
            added_p50_ms=statistics.median(lat[name]) * 1e3 - d50,
            cpu_ms=cpu[name] / len(bodies) / 1e6,
            p50_ms=statistics.median(lat[name]) * 1e3,
            direct_p50_ms=d50,
        )
        for name in routers
    ]


async def probe(name: str, url: str, tokens: int, small: int) -> Probe:
    """`small` small requests' P99 alone, then while new `tokens`-token prompts flow to
    the same URL from a process of their own (building and sending them here would hold
    up this loop's clock)."""
    words = max(1, round(tokens * 4 / _CHARS_PER_WORD))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for _ in range(20):
            await _send(http, url, _SMALL)
        quiet = [await _send(http, url, _SMALL) for _ in range(small)]
        spawn = multiprocessing.get_context("spawn")  # no copy of this loop
        ready, stop, sent = spawn.Event(), spawn.Event(), spawn.Value("i", 0)
        sender = spawn.Process(target=_long_prompts, args=(url, words, ready, stop, sent))
        sender.start()
        try:
            await asyncio.to_thread(ready.wait, 60)
            busy = [await _send(http, url, _SMALL) for _ in range(small)]
            # and on until a long prompt has gone through wholly beside them (a busy
            # machine may have sent them all within the first one)
            deadline = time.monotonic() + 60
            while sent.value < 2 and time.monotonic() < deadline:
                busy.append(await _send(http, url, _SMALL))
        finally:
            stop.set()
            await asyncio.to_thread(sender.join, 30)
    return Probe(name, percentile(quiet, 0.99) * 1e3, percentile(busy, 0.99) * 1e3, sent.value)


@contextlib.contextmanager
def pinned(measured: int, others: Sequence[int], pin: bool) -> Iterator[None]:
    """With `pin` (and two CPUs or more), the process measured (its tree) alone on the
    first CPU and `others` (theirs, this process's: the probe's client and the long
    prompts' sender) on the rest, so that the probe measures the router's own loop, not
    the scheduler sharing a core between it and the load; all on every CPU after."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        yield
        return
    trees = [procstat.tree(p) for p in others]
    _set_affinity([p for tree in trees for p in tree], set(cpus[1:]))
    _set_affinity(procstat.tree(measured), {cpus[0]})
    try:
        with _first_in_line():
            yield
    finally:
        _set_affinity([p for tree in trees for p in tree], set(cpus))


@contextlib.contextmanager
def _first_in_line() -> Iterator[None]:
    """This thread (the probe's client) runs before the load sharing its CPU
    (SCHED_FIFO where this user may set it; children keep the default policy): the small
    requests' times are then the router's and the backend's, not the client's own waits
    behind the long prompts' sender."""
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
        moved = True
    except PermissionError:  # not root, nor CAP_SYS_NICE: as before
        moved = False
    try:
        yield
    finally:
        if moved:
            os.sched_setscheduler(0, *before)


def _set_affinity(pids: Sequence[int], cpus: set[int]) -> None:
    """Every thread of `pids` on `cpus` (a process gone meanwhile is skipped)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    os.sched_setaffinity(int(task.name), cpus)


def _long_prompts(url: str, words: int, ready: Event, stop: Event, sent: Synchronized) -> None:
    """New long chat prompts to `url`, one after the other, until `stop`: one document,
    each time behind a new first line, so that none shares a block with another. `ready`
    once the first one went through (they flow from then on). A body is the document's
    JSON bytes behind its new line's, joined (not encoded anew): the sender shares the
    machine with what it measures, and should take little of it."""
    body = orjson.loads(chat_body(words, 1_000_000))
    document = body["messages"][0]["content"]
    body["messages"][0]["content"] = "\0"
    head, tail = orjson.dumps(body).split(b"\\u0000")
    escaped = orjson.dumps(document)[1:-1]
    host, port = urllib.parse.urlsplit(url).netloc.split(":")
    conn = http.client.HTTPConnection(host, int(port))
    while not stop.is_set():
        conn.request("POST", _CHAT, b"".join((head, b"%d " % sent.value, escaped, tail)), _HEADERS)
        conn.getresponse().read()
        sent.value += 1
        ready.set()
    conn.close()


@contextlib.contextmanager
def routers(
    backend: str, strategies: Sequence[str], workers: int, peers: bool, workdir: Path
) -> Iterator[dict[str, tuple[str, int]]]:
    """kvroute per strategy (and the peers' cache_aware routers with `peers`) in front of
    `backend`: name -> (URL, pid), once each routes."""
    starts: dict[str, list[str]] = {}
    for strategy in strategies:
        config = {"backends": [{"url": backend}], "routing": {"strategy": strategy}}
        config |= {"workers": workers, "access_log": {"path": str(workdir / f"{strategy}.log")}}
        starts[f"kvroute {strategy}"] = kvroute_serve(config, workdir / f"{strategy}.json")
    for peer in find_peers(PEERS_VENV, install=True) if peers else ():
        if peer.policy != "cache_aware":
            continue
        if peer.python is None:
            print(f"{peer.label}: not measured: {peer.version}", file=sys.stderr)
            continue
        starts[peer.label] = peer_cmd(Path(peer.python), peer.package, [backend], 0, peer.policy)
    with contextlib.ExitStack() as stack:
        out: dict[str, tuple[str, int]] = {}
        for name, cmd in starts.items():
            port = free_port()
            cmd = on_port(cmd, port)
            proc = stack.enter_context(logged(cmd, workdir / f"{len(out)}.out"))
            url = f"http://127.0.0.1:{port}"
            asyncio.run(wait_routable(url, proc))
            out[name] = (url, proc.pid)
        yield out


def table(cells: Sequence[Cell]) -> list[str]:
    """Added P50 / CPU per request, a line per size and mode, a column per router."""
    names = list(dict.fromkeys(c.router for c in cells))
    by = {(c.router, c.words, c.mode): c for c in cells}
    head = f"| prompt (words) | mode | direct P50 | {' | '.join(names)} |"
    lines = [head, "|" + "---|" * (3 + len(names))]
    for words, mode in dict.fromkeys((c.words, c.mode) for c in cells):
        row = [by[(n, words, mode)] for n in names]
        cols = " | ".join(f"{c.added_p50_ms:.2f} ms / {c.cpu_ms:.2f} ms" for c in row)
        lines.append(f"| {words:,} | {mode} | {row[0].direct_p50_ms:.2f} ms | {cols} |")
    return lines


def ratios(cells: Sequence[Cell], router: str) -> list[str]:
    """`router`'s added P50 and CPU per request over the best peer's, per size and mode."""
    peers = {c.router for c in cells if not c.router.startswith("kvroute")}
    if not peers:
        return []
    lines = []
    for words, mode in dict.fromkeys((c.words, c.mode) for c in cells):
        here = [c for c in cells if (c.words, c.mode) == (words, mode)]
        mine = next(c for c in here if c.router == router)
        others = [c for c in here if c.router in peers]
        p50 = min(c.added_p50_ms for c in others)
        cpu = min(c.cpu_ms for c in others)
        lines.append(
            f"{words:>7,} words, {mode:8}: added P50 {_ratio(mine.added_p50_ms, p50)}, "
            f"CPU {_ratio(mine.cpu_ms, cpu)} the best peer's"
        )
    return lines


def _ratio(mine: float, best: float) -> str:
    """`mine` over `best`; none when `best` is within the noise of nothing."""
    return f"{mine / best:5.2f}x" if best > 0.05 else f"{mine:.2f} ms against {best:.2f} ms"


def _strategies(given: list[str]) -> list[str]:
    if "all" in given:
        return policies.names()
    return [policies.canonical(s) or s for s in given] or [DEFAULT_STRATEGY]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="prompt words")
    parser.add_argument("--requests", type=int, default=20, help="per size and mode")
    parser.add_argument(
        "--strategy",
        action="append",
        default=[],
        help=f"kvroute strategy, repeatable, or all (default {DEFAULT_STRATEGY})",
    )
    parser.add_argument("--workers", type=int, default=0, help="0: one per core (default)")
    parser.add_argument("--peers", action="store_true", help="also sglang-router, vllm-router")
    parser.add_argument("--probe-tokens", type=int, default=100_000, help="0: no probe")
    parser.add_argument("--probe-requests", type=int, default=400)
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="leave the probe's processes to the scheduler (default: the one measured "
        "alone on the first CPU, the load on the others)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    strategies = _strategies(args.strategy)
    backend = [sys.executable, "-m", "bench.studies.instant_backend", "--port", "0"]
    with tempfile.TemporaryDirectory() as tmp, process(backend) as instant:
        direct = instant.stdout.readline().strip()
        with routers(direct, strategies, args.workers, args.peers, Path(tmp)) as running:
            cells = asyncio.run(measure(direct, running, sizes, args.requests))
    probes = []
    # the probe's backend is the raw one: aiohttp's parsing of long bodies would delay
    # the small requests there, and the probe is about the router's loop
    with tempfile.TemporaryDirectory() as tmp, process([*backend, "--raw"]) as raw:
        direct = raw.stdout.readline().strip()
        with routers(direct, [strategies[0]], 1, False, Path(tmp)) as one:
            ((url, pid),) = one.values()
            targets = {
                "the raw backend, direct": (direct, raw.pid),
                f"kvroute {strategies[0]}, 1 worker": (url, pid),
            }
            for name, (target, measured) in targets.items() if args.probe_tokens else ():
                tokens, small = args.probe_tokens, args.probe_requests
                with pinned(measured, [raw.pid, pid, os.getpid()], args.pin):
                    probes.append(asyncio.run(probe(name, target, tokens, small)))
    _print(cells, probes, args, strategies[0])
    if args.json:
        data = {"cells": cells, "probes": [msgspec.to_builtins(p) for p in probes]}
        Path(args.json).write_bytes(msgspec.json.encode(data))
    return 0


def _print(cells: list[Cell], probes: list[Probe], args: argparse.Namespace, first: str) -> None:
    workers = args.workers or "default"
    print(
        f"long prompts: {args.requests} sequential chat requests per size and mode, "
        f"added P50 / router CPU per request, kvroute workers: {workers}"
    )
    print("\n".join(table(cells)))
    print("\n".join(ratios(cells, f"kvroute {first}")))
    for p in probes:
        print(
            f"small-request P99 through {p.router}: {p.quiet_p99_ms:.2f} ms alone, "
            f"{p.busy_p99_ms:.2f} ms beside {p.long_prompts} new {args.probe_tokens:,}-token "
            f"prompts: {p.added_ms:+.2f} ms"
        )


if __name__ == "__main__":
    sys.exit(main())
