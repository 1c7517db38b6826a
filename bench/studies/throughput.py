"""kvroute beside the Rust routers on PyPI, one trivial backend, one run, one table.

Rows: the backend called directly (the baseline), kvroute with 1 worker and with one
worker per usable core, a bare TCP pipe on uvloop (bench.studies.pipe: the floor under any
Python proxy here, whatever it does per request), sglang-router and vllm-router (both
round robin over the one backend). The backend is `bench.studies.instant_backend --raw` (~30,000
requests/s on one core), so the routers, not the backend, saturate first. Every router
is started up front (an idle one costs nothing) and each phase takes the rows in turn,
`--rounds` times for the rates, reporting the median round, so a burst of machine noise
hits every row alike:

- **req/s**: the most non-streaming chat requests per second, from `wrk` (Debian:
  `apt-get install -y wrk`) POSTing bench.studies.overhead's body over `--connections`
  keep-alive connections for `--seconds`, with the router's CPU (cores) over the run;
- **added latency** P50/P99 over calling the backend directly, sequential and at
  `--concurrency` (bench.studies.overhead.compare: the two paths interleaved in batches; the
  targets taken in turn over `--rounds`, each target's samples pooled);
- **memory**: RSS summed over every router process (from /proc) with `--mem-streams`
  slow streams open, minus the same sum just before, per 1,000 streams (measured before
  the SSE phase has grown any heap);
- **SSE events/s**: `--sse-streams` endless streams paced at one event every
  `--sse-interval` s each (a vLLM decode step's shape: one event per stream per step),
  read by bench.studies.streams; the backend starts the events once all are open (`--hold`).
  Events delivered per second, the router's CPU, and events per router CPU-second
  (what one busy worker would forward).

The peers are pip-installed into their own virtualenv (`--peers-venv`, created on first
use), so the project's dependencies are untouched; a peer that cannot be installed or
started is "n/a" with the reason. On a 2-core machine the client, `wrk`, the backend
and the router share the cores: compare rows with each other, and per router core.

    python -m bench.studies.throughput                    # every row, 2-3 minutes on 2 cores
    python -m bench.studies.throughput --quick --no-peers --json out.json

Reproduces docs/performance.md, "Throughput beside the Rust routers".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import aiohttp
import orjson

from bench.harness.peers import PEERS, PEERS_VENV, ensure_peers, peer_cmd
from bench.harness.processes import (
    PING_BODY,
    free_port,
    kvroute_serve,
    log_tail,
    logged,
    process,
    wait_ready,
    wait_routable,
)
from bench.harness.procstat import rss_mb, tree_cpu_seconds
from bench.studies import overhead
from bench.studies.instant_backend import MODEL, SLOW_MODEL
from bench.studies.overhead import parser_for, write_json
from bench.studies.streams import Board, Stream, open_streams
from router.control.supervisor import usable_cores

__all__ = [
    "FLOOR",
    "PEERS",
    "WRK_HINT",
    "Row",
    "Target",
    "kvroute_cmd",
    "main",
    "parser",
    "router_starts",
    "run",
    "start_routers",
    "table",
]

WRK_HINT = "wrk is not installed: `apt-get install -y wrk` (Debian/Ubuntu) adds it"
FLOOR = "bare TCP pipe, uvloop (floor)"


@dataclass
class Row:
    """One target's figures; None where not measured, `note` says why."""

    name: str
    rps: float | None = None
    rps_cores: float | None = None
    wrk_errors: int = 0
    latency: dict[str, dict[str, float]] = field(default_factory=dict)
    sse_eps: float | None = None
    sse_cores: float | None = None
    sse_errors: int = 0
    stream_error: str = ""  # the first stream failure, as an example
    mem_mb_per_1k: float | None = None
    mem_idle_mb: float | None = None
    version: str = ""
    note: str = ""


# --- the routers -----------------------------------------------------------------------------


def kvroute_cmd(backend: str, port: int, workers: int, strategy: str, tmp: Path) -> list:
    """kvroute on `port` in front of the one backend, with limits wrk does not reach."""
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "backends": [{"url": backend}],
        "routing": {"strategy": strategy},
        "limits": {"max_concurrent_requests": 100_000},
        "shutdown": {"drain_seconds": 1},
    }
    cmd = kvroute_serve(config, tmp / f"kvroute-{port}.yaml")
    return [*cmd, "--log-level", "warning", "--workers", str(workers)]


@dataclass
class _Start:
    """A router to start for `row`; only kvroute has /ready to wait on first."""

    row: Row
    cmd: list[str]
    port: int
    kvroute: bool


def router_starts(direct: str, args, tmp: Path) -> list[_Start | Row]:
    """What to start, in table order; a bare Row is one that cannot run (note says why)."""
    cores = usable_cores()
    out: list[_Start | Row] = []
    for n in (1, cores) if cores > 1 else (1,):
        port = free_port()
        cmd = kvroute_cmd(direct, port, n, args.strategy, tmp)
        out.append(_Start(Row(f"kvroute --workers {n}"), cmd, port, True))
    port = free_port()
    cmd = [sys.executable, "-m", "bench.studies.pipe", "--backend", direct, "--port", str(port)]
    out.append(_Start(Row(FLOOR), cmd, port, False))
    if args.no_peers:
        return out
    for package, (python, version) in ensure_peers(Path(args.peers_venv), args.install).items():
        if python is None:
            out.append(Row(package, note="; " + version))
            continue
        port = free_port()
        cmd = peer_cmd(python, package, [direct], port)
        out.append(_Start(Row(package, version=version), cmd, port, False))
    return out


def start_routers(stack: contextlib.ExitStack, starts: list, tmp: Path) -> list[Target]:
    """Start every router at once (idle ones cost nothing), then wait for each."""
    targets, waits = [], []
    for start in starts:
        if isinstance(start, Row):
            targets.append(Target(start))
            continue
        log = tmp / f"{start.port}.log"
        proc = stack.enter_context(logged(start.cmd, log))
        targets.append(Target(start.row, f"http://127.0.0.1:{start.port}", proc.pid))
        waits.append((targets[-1], proc, log, start.kvroute))
    for target, proc, log, kvroute in waits:
        try:
            if kvroute:
                asyncio.run(wait_ready(target.url, timeout=40))
            asyncio.run(wait_routable(target.url, proc))
        except Exception as exc:
            target.row.note += f"; did not start: {exc} ({log_tail(log)})"
            target.url = ""
    return targets


# --- measurements --------------------------------------------------------------------------


def wrk_script(tmp: Path) -> Path:
    path = tmp / "post.lua"
    path.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [[{PING_BODY.decode()}]]\n"
    )
    return path


def run_wrk(url: str, args, script: Path, seconds: float, row: Row | None = None) -> float:
    """Requests/s; failed requests (non-2xx, socket errors) are added to `row`."""
    duration = f"-d{max(1, round(seconds))}s"  # wrk takes whole seconds
    cmd = ["wrk", f"-t{args.wrk_threads}", f"-c{args.connections}", duration]
    out = subprocess.run(
        [*cmd, "-s", str(script), url + "/v1/chat/completions"],
        capture_output=True,
        text=True,
        timeout=seconds + 30,
    ).stdout
    found = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not found:
        raise RuntimeError(f"wrk printed no rate: {out[-300:]!r}")
    if row is not None:
        errors = re.findall(r"(?:connect|read|write|timeout|responses:) (\d+)", out)
        row.wrk_errors += sum(int(n) for n in errors)
    return float(found.group(1))


def _timed(root: int | None, work: Callable[[], float]) -> tuple[float, float | None]:
    """(what `work` returns, the router's CPU cores over it: None without a router)."""
    cpu0, t0 = tree_cpu_seconds(root) if root else 0.0, time.monotonic()
    rate = work()
    return rate, (tree_cpu_seconds(root) - cpu0) / (time.monotonic() - t0) if root else None


def _latency_round(t: Target, direct: str, args) -> None:
    """A `--rounds`-th of the requests, sequential and concurrent, pooled per target."""
    per = max(1, args.requests // args.rounds)
    for label, conc in (("seq", 1), (f"c{args.concurrency}", args.concurrency)):
        lat = asyncio.run(overhead.compare({"direct": direct, "router": t.url}, per, conc))
        pooled = t.lat.setdefault(label, {"direct": [], "router": []})
        for path, samples in lat.items():
            pooled[path] += samples


def phase_latency(live: list[Target], args, direct: str) -> None:
    _rounds(live, args.rounds, "latency", lambda t: _latency_round(t, direct, args))
    for t in live:
        t.row.latency = {label: overhead.summarize(lat) for label, lat in t.lat.items()}


def _stream_body(model: str) -> bytes:
    messages = [{"role": "user", "content": "stream please"}]
    return orjson.dumps({"model": model, "messages": messages, "stream": True, "max_tokens": 10**7})


async def _close_all(streams: list[Stream], board: Board, backend: str) -> None:
    """Close every stream, then wait until the router has let go of the backend's side
    too (else the backend's `--hold` would count them in the next run)."""
    for stream in streams:
        stream.close()
    with contextlib.suppress(TimeoutError):
        await board.wait_closed(30)
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(backend + "/debug/streams") as resp:
                left = sum((await resp.json()).values())
            if not left:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{left} upstream streams open 30 s after the clients left")
            await asyncio.sleep(0.05)


async def sse_rate(
    url: str, root: int | None, args, backend: str
) -> tuple[float, float | None, list[str]]:
    """(events/s, router cores, stream failures) with `--sse-streams` endless fast streams."""
    board = Board()
    streams = await open_streams(url, args.sse_streams, _stream_body(MODEL), board, timeout=30)
    try:
        await asyncio.sleep(args.warmup)
        e0 = board.events
        cpu0, t0 = tree_cpu_seconds(root) if root else 0.0, time.monotonic()
        await asyncio.sleep(args.sse_seconds)
        elapsed = time.monotonic() - t0
        cores = (tree_cpu_seconds(root) - cpu0) / elapsed if root else None
        return (board.events - e0) / elapsed, cores, board.errors
    finally:
        await _close_all(streams, board, backend)


async def measure_memory(row: Row, url: str, root: int, args, backend: str) -> None:
    """RSS of the router's processes with `--mem-streams` slow streams open, minus idle."""
    idle = rss_mb(root)
    board = Board()
    body = _stream_body(SLOW_MODEL)
    streams = await open_streams(url, args.mem_streams, body, board, timeout=30)
    try:
        await asyncio.sleep(1.0)  # every stream has had a slow event or two
        held = rss_mb(root)
        if board.errors:
            row.note += f"; {len(board.errors)} of {args.mem_streams} streams failed"
            row.stream_error = row.stream_error or board.errors[0]
        opened = args.mem_streams - len(board.errors)
        row.mem_idle_mb = idle
        row.mem_mb_per_1k = (held - idle) * 1000 / max(1, opened)
    finally:
        await _close_all(streams, board, backend)


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Target:
    """One row's subject: a URL to load and, for a router, its top process."""

    row: Row
    url: str = ""  # empty: not running (the row's note says why)
    root: int | None = None  # None for the backend itself
    rps: list[tuple[float, float | None]] = field(default_factory=list)  # per round
    sse: list[tuple[float, float | None]] = field(default_factory=list)
    lat: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # pooled rounds

    def attempt(self, phase: str, work: Callable[[], None]) -> None:
        """Run one phase on this target; a failure is a note, and the run goes on."""
        print(f"  {self.row.name}: {phase}", flush=True)
        try:
            work()
        except Exception as exc:
            self.row.note += f"; {phase} failed: {exc!r}"[:300]


def _median_pair(samples: list[tuple[float, float | None]]) -> tuple[float, float | None]:
    """The round with the median rate (its CPU goes with it)."""
    ordered = sorted(samples, key=lambda s: s[0])
    return ordered[(len(ordered) - 1) // 2]


def _wrk_round(t: Target, args, script: Path) -> None:
    work = partial(run_wrk, t.url, args, script, args.seconds, t.row)
    t.rps.append(_timed(t.root, work))


def _sse_round(t: Target, args, backend: str) -> None:
    eps, cores, errors = asyncio.run(sse_rate(t.url, t.root, args, backend))
    t.sse.append((eps, cores))
    t.row.sse_errors += len(errors)
    t.row.stream_error = t.row.stream_error or next(iter(errors), "")


def _rounds(live: list[Target], rounds: int, what: str, one: Callable[[Target], None]) -> None:
    """`rounds` runs per target, the targets taken in turn each round, so a burst of
    machine noise hits every row alike (the median round counts)."""
    for _ in range(rounds):
        for t in live:
            t.attempt(what, partial(one, t))


def phase_rps(live: list[Target], args, script: Path) -> None:
    for t in live:  # warm every path first (connection pools, lazy imports)
        t.attempt("wrk warm-up", partial(run_wrk, t.url, args, script, 1))
    _rounds(live, args.rounds, "wrk", lambda t: _wrk_round(t, args, script))
    for t in (t for t in live if t.rps):
        t.row.rps, t.row.rps_cores = _median_pair(t.rps)


def phase_sse(live: list[Target], args, backend: str) -> None:
    _rounds(live, args.rounds, "sse", lambda t: _sse_round(t, args, backend))
    for t in (t for t in live if t.sse):
        t.row.sse_eps, t.row.sse_cores = _median_pair(t.sse)


def run(args) -> tuple[list[Row], dict]:
    wrk = shutil.which("wrk") is not None
    if not wrk:
        print(WRK_HINT + "; the req/s column is skipped", file=sys.stderr)
    backend_cmd = [sys.executable, "-m", "bench.studies.instant_backend", "--raw", "--port", "0"]
    backend_cmd += ["--interval", str(args.sse_interval), "--hold", str(args.sse_streams)]
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvroute-bench-")))
        direct = stack.enter_context(process(backend_cmd)).stdout.readline().strip()
        base = Target(Row("backend direct (baseline)"), direct)
        print("starting the routers ...", flush=True)
        routers = start_routers(stack, router_starts(direct, args, tmp), tmp)
        live = [base, *(t for t in routers if t.url)]
        if wrk:
            phase_rps(live, args, wrk_script(tmp))
        phase_latency(live[1:], args, direct)
        for t in live[1:]:  # before the SSE phase, whose streams would grow the idle heap
            memory = partial(measure_memory, t.row, t.url, t.root, args, direct)
            t.attempt("memory", lambda memory=memory: asyncio.run(memory()))
        phase_sse(live, args, direct)
    return [base.row, *(t.row for t in routers)], _meta(args, wrk)


def _meta(args, wrk: bool) -> dict:
    return {
        "cores": len(os.sched_getaffinity(0)),
        "loadavg": os.getloadavg(),
        "rounds": args.rounds,
        "wrk": f"-t{args.wrk_threads} -c{args.connections} -d{args.seconds}s" if wrk else None,
        "strategy": args.strategy,
        "sse": f"{args.sse_streams} streams, 1 event / {args.sse_interval:g} s each",
        "mem_streams": args.mem_streams,
    }


# --- the table -------------------------------------------------------------------------------


def _f(value: float | None, fmt: str = "{:,.0f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def _lat(row: Row, key: str, direct: bool) -> str:
    s = row.latency.get(key)
    if s is None:
        return "n/a"
    if direct:
        return f"{s['direct_p50_ms']:.2f} / {s['direct_p99_ms']:.2f}"
    return f"{s['added_p50_ms']:.2f} / {s['added_p99_ms']:.2f}"


def _find(rows: list[Row], prefix: str) -> Row | None:
    return next((r for r in rows if r.name.startswith(prefix)), None)


def _per_core(rate: float | None, cores: float | None) -> float | None:
    return rate / cores if rate and cores else None


def _cells(r: Row, conc: int, direct: bool) -> list[str]:
    note = r.note.strip("; ")
    if direct:
        note = ("latency cells: the direct call itself; " + note).strip("; ")
    notes = [f"v{r.version}"] if r.version else []
    notes += [f"{r.wrk_errors} wrk errors"] if r.wrk_errors else []
    notes += [f"{r.sse_errors} stream errors"] if r.sse_errors else []
    notes += [f"first stream error: {r.stream_error[:120]}"] if r.stream_error else []
    return [
        r.name,
        _f(r.rps),
        _f(r.rps_cores, "{:.2f}"),
        _f(_per_core(r.rps, r.rps_cores)),
        _lat(r, "seq", direct),
        _lat(r, f"c{conc}", direct),
        _f(r.sse_eps),
        _f(r.sse_cores, "{:.2f}"),
        _f(_per_core(r.sse_eps, r.sse_cores)),
        _f(r.mem_mb_per_1k, "{:.1f}"),
        "; ".join([*notes, note] if note else notes),
    ]


def table(rows: list[Row], meta: dict, conc: int) -> str:
    """The markdown table and the goal lines under it."""
    # the direct row shows the absolute latency the other rows add to
    ref = next((r for r in rows[1:] if r.latency), None)
    rows[0].latency = ref.latency if ref else {}
    head = (
        "| target | req/s | router cores | req/s per router core "
        f"| added P50 / P99 ms, sequential | added P50 / P99 ms, {conc} concurrent "
        "| SSE events/s | router cores | events/s per router core | MB per 1k streams "
        "| notes |"
    )
    lines = [head, "|" + "---|" * 11]
    lines += ["| " + " | ".join(_cells(r, conc, i == 0)) + " |" for i, r in enumerate(rows)]
    return "\n".join(lines) + "\n\n" + "\n".join(goals(rows, meta))


def goals(rows: list[Row], meta: dict) -> list[str]:
    many = _find(rows, f"kvroute --workers {meta['cores']}") or _find(rows, "kvroute")
    one = _find(rows, "kvroute --workers 1") or _find(rows, "kvroute")
    sglang = _find(rows, "sglang-router")
    out = [
        f"cores {meta['cores']}, load average {meta['loadavg'][0]:.1f}; "
        f"medians of {meta['rounds']} rounds; wrk {meta['wrk']}; SSE {meta['sse']}; "
        f"memory with {meta['mem_streams']} slow streams; kvroute {meta['strategy']}",
        "",
    ]
    if many and sglang and many.rps and sglang.rps:
        ratio = many.rps / sglang.rps
        out.append(f"- req/s, {many.name} / sglang-router: {ratio:.2f} (goal >= 0.5)")
        mine, theirs = _per_core(many.rps, many.rps_cores), _per_core(sglang.rps, sglang.rps_cores)
        if mine and theirs:
            out.append(f"- req/s per router core, the same ratio: {mine / theirs:.2f}")
    if one and one.latency.get("seq"):
        added = one.latency["seq"]["added_p50_ms"]
        out.append(f"- added P50, sequential, {one.name}: {added:.2f} ms (goal <= 0.35)")
    if one and one.sse_eps:
        out.append(
            f"- SSE events/s, {one.name}: {one.sse_eps:,.0f} delivered, "
            f"{_f(_per_core(one.sse_eps, one.sse_cores))} per router core "
            "(goal >= 50,000 per worker)"
        )
    floor = _find(rows, FLOOR)
    if one and floor:
        out += _beside_floor(one, floor)
    if many and many.mem_mb_per_1k is not None:
        out.append(
            f"- memory, {many.name}: {many.mem_mb_per_1k:.1f} MB per 1,000 open streams "
            f"over {many.mem_idle_mb:.0f} MB idle (goal < 50)"
        )
    return out


def _beside_floor(one: Row, floor: Row) -> list[str]:
    """kvroute against the bare pipe: how much of each figure is the router's own."""
    out = []
    mine, bare = one.latency.get("seq"), floor.latency.get("seq")
    if mine and bare:
        own = mine["added_p50_ms"] - bare["added_p50_ms"]
        out.append(
            f"- added P50, sequential, of the bare pipe: {bare['added_p50_ms']:.2f} ms; "
            f"{one.name}'s own over it: {own:.2f} ms"
        )
    mine_sse, bare_sse = (_per_core(r.sse_eps, r.sse_cores) for r in (one, floor))
    if mine_sse and bare_sse:
        out.append(
            f"- SSE events per router core, {one.name} / the bare pipe: "
            f"{mine_sse / bare_sse:.2f} (the pipe: {bare_sse:,.0f})"
        )
    return out


def to_json(rows: list[Row], meta: dict) -> dict:
    return {"meta": meta, "rows": [r.__dict__ for r in rows]}


def parser():
    p = parser_for(__doc__, 64)
    p.set_defaults(requests=1000, strategy="ROUND_ROBIN")
    p.add_argument("--out", dest="json", metavar="FILE", help="the same as --json")
    p.add_argument("--rounds", type=int, default=3, help="wrk and SSE runs per target")
    p.add_argument("--seconds", type=int, default=3, help="one wrk run")
    p.add_argument("--warmup", type=float, default=0.5, help="streams open before counting")
    p.add_argument("--connections", type=int, default=64, help="wrk's keep-alive connections")
    p.add_argument("--wrk-threads", type=int, default=1)
    p.add_argument("--sse-streams", type=int, default=1000)
    p.add_argument("--sse-interval", type=float, default=0.01, help="seconds between events")
    p.add_argument("--sse-seconds", type=float, default=2.0, help="one SSE run")
    p.add_argument("--mem-streams", type=int, default=2000)
    p.add_argument("--no-peers", action="store_true", help="kvroute rows only")
    p.add_argument("--no-install", dest="install", action="store_false", help="never pip")
    p.add_argument("--peers-venv", default=str(PEERS_VENV))
    p.add_argument("--quick", action="store_true", help="a smoke run of every phase (~15 s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.warmup, args.requests = 1, 1, 0.0, 50
        args.sse_streams, args.sse_seconds, args.mem_streams = 20, 1.0, 50
    rows, meta = run(args)
    print(table(rows, meta, args.concurrency))
    if args.json:
        write_json(args.json, to_json(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
