"""New requests while a router relays many streams: do they get their turn?

For each target (the backend called directly, kvroute with one worker and with one per
core, and the Rust routers when `bench.studies.throughput` installed them), against one raw
instant backend that writes an event on every open stream each `--interval` seconds:

1. a holder process opens `--streams` endless streams through the target, at most 100
   awaiting their first bytes at a time, while the ones already open stream: how long
   the last took to open and how many failed (a 60 s timeout, a 5xx) is the first
   measure;
2. with all of them streaming, this process sends `--probes` sequential chat requests
   (a kept connection) and reports their latency: the second measure;
3. the holder reports the events/s it received meanwhile, then closes its streams.

What it showed (docs/performance.md, "New requests while streams flow"): one worker
relaying 2,000 streams opens them as fast as the Rust routers and answers most new
requests in a few ms, but a few wait seconds.
uvloop (libuv) polls again at once, up to 48 times, while a poll returns a full batch of
1,024 ready sockets, and runs the ready callbacks (every task step) only after: relays
write from the poll's own callbacks, so a new request's next step can wait for a whole
burst of relaying.

One worker is the hard case: every relayed event and every new request share one event
loop. The holder and this process are separate processes with loops of their own, so a
saturated client does not pass for a slow router. On 2 cores the backend, the target,
the holder and the prober share them: compare the targets within one run.

    python -m bench.studies.fairness --streams 2000 --interval 0.01

Reproduces docs/performance.md, "New requests while streams flow".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import uvloop

from bench.harness.peers import PEERS_VENV, ensure_peers, peer_cmd
from bench.harness.processes import JSON_HEADERS, PING_BODY, free_port, process
from bench.studies.streams import Board, open_streams
from bench.studies.throughput import (
    MODEL,
    Row,
    _close_all,
    _Start,
    _stream_body,
    kvroute_cmd,
    start_routers,
)
from router.control.supervisor import usable_cores


@dataclass
class Result:
    name: str
    opened: int = 0
    failed: int = 0
    open_seconds: float = 0.0
    first_error: str = ""
    probes_ms: list[float] | None = None
    events_per_s: float = 0.0
    note: str = ""


async def hold(url: str, backend: str, n: int) -> None:
    """The holder: open `n` streams, say how it went, keep them until a line comes on
    stdin, say the rate meanwhile, close them."""
    board = Board()
    t0 = time.monotonic()
    streams = await open_streams(url, n, _stream_body(MODEL), board, timeout=60)
    opened = {
        "opened": board.open,
        "failed": len(board.errors),
        "open_seconds": time.monotonic() - t0,
        "first_error": board.errors[0][:160] if board.errors else "",
    }
    print(orjson.dumps(opened).decode(), flush=True)
    e0, t1 = board.events, time.monotonic()
    await asyncio.to_thread(sys.stdin.readline)
    rate = (board.events - e0) / (time.monotonic() - t1)
    print(orjson.dumps({"events_per_s": rate}).decode(), flush=True)
    await _close_all(streams, board, backend)


async def probe(url: str, n: int) -> list[float]:
    """Latencies (ms) of `n` sequential chat requests on one kept connection."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for _ in range(n):
            t0 = time.perf_counter()
            async with http.post(
                url + "/v1/chat/completions", data=PING_BODY, headers=JSON_HEADERS
            ) as resp:
                await resp.read()
            out.append((time.perf_counter() - t0) * 1e3)
            await asyncio.sleep(0.02)
    return out


def measure(name: str, url: str, backend: str, args) -> Result:
    result = Result(name)
    cmd = [sys.executable, "-m", "bench.studies.fairness", "--hold", url, "--backend", backend]
    cmd += ["--streams", str(args.streams)]
    holder = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline()
        if not line:
            result.note = f"the holder exited with {holder.wait()}"
            return result
        for key, value in orjson.loads(line).items():
            setattr(result, key, value)
        result.probes_ms = asyncio.run(probe(url, args.probes))
        holder.stdin.write("stop\n")
        holder.stdin.flush()
        result.events_per_s = orjson.loads(holder.stdout.readline() or b"{}").get(
            "events_per_s", 0.0
        )
        holder.wait(120)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    return result


def targets(
    stack: contextlib.ExitStack, direct: str, args, tmp: Path
) -> list[tuple[str, str, str]]:
    """(name, url, note) of every target; no url if it did not start (the note says why)."""
    starts = []
    for n in sorted({1, usable_cores()}):
        port = free_port()
        cmd = kvroute_cmd(direct, port, n, "ROUND_ROBIN", tmp)
        starts.append(_Start(Row(f"kvroute --workers {n}"), cmd, port, True))
    for package, (python, version) in ensure_peers(Path(args.peers_venv), False).items():
        if python is not None:
            port = free_port()
            cmd = peer_cmd(python, package, [direct], port)
            starts.append(_Start(Row(f"{package} {version}"), cmd, port, False))
    started = start_routers(stack, starts, tmp)
    return [("backend direct", direct, "")] + [(t.row.name, t.url, t.row.note) for t in started]


def table(results: list[Result], args) -> str:
    head = (
        f"{args.streams} streams, an event on each every {args.interval} s; "
        f"{args.probes} sequential requests once they stream\n"
        "| target | opened | failed | all opened after s | requests P50 ms | P99 | max "
        "| events/s |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for r in results:
        if r.probes_ms is None:
            rows.append(f"| {r.name} | " + " | ".join(["n/a"] * 7) + f" | {r.note}")
            continue
        p = sorted(r.probes_ms)
        p99 = p[min(len(p) - 1, int(len(p) * 0.99))]
        cells = [
            r.name,
            str(r.opened),
            f"{r.failed}" + (f" ({r.first_error[:60]})" if r.failed else ""),
            f"{r.open_seconds:.1f}",
            f"{statistics.median(p):.1f}",
            f"{p99:.1f}",
            f"{p[-1]:.1f}",
            f"{r.events_per_s:,.0f}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--interval", type=float, default=0.01, help="seconds between events")
    parser.add_argument("--probes", type=int, default=100)
    parser.add_argument(
        "--peers-venv",
        default=str(PEERS_VENV),
        help="where bench.studies.throughput installed the Rust routers (used if present)",
    )
    parser.add_argument("--hold", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hold:
        uvloop.run(hold(args.hold, args.backend, args.streams))
        return 0
    backend_cmd = [sys.executable, "-m", "bench.studies.instant_backend", "--raw", "--port", "0"]
    backend_cmd += ["--interval", str(args.interval)]
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvroute-fair-")))
        direct = stack.enter_context(process(backend_cmd)).stdout.readline().strip()
        results = [
            measure(name, url, direct, args) if url else Result(name, note=note.lstrip("; "))
            for name, url, note in targets(stack, direct, args, tmp)
        ]
    print(table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
