"""KV events at fleet rate: how many block events per second one collector applies.

For each fleet size it starts fake vLLM backends in a child process (the generator: each
backend an HTTP port answering /health, /v1/models and /metrics (a vLLM page, scraped
every second as a real one would be), bench/studies/instant_backend.py's, and a
ZMQ publisher of vLLM-format event batches, bench/sim/publisher.py's) and a real
`kvroute serve` (KV_AWARE, every backend with `kv_events`, `--workers` as given: 0 is
one per core, so a collector subscribes and feeds the workers). The backends publish
`--rate` events a second each, one batch every `--interval` seconds, as an engine step
would: half BlockStored (one block each, chained to the block before), half BlockRemoved
of the block stored `--window` blocks earlier, so each backend holds a steady window.

Per row: events offered per second, and applied per second (the router's
kvroute_kv_events_applied_total, from the window's start until it counts them all: a
backlog lowers it), the CPU of the collector, of the rest of the router and of the
generator over that span (each a share of one core, bench/harness/procstat.py), how many of the
events were applied in the end, and the visibility lag: the age of the newest batch a
worker shows on /debug/routing (`events_published`), sampled until then, P50/P99 (the
lag itself plus up to one batch interval; where the workers share the collector's index,
which they read at once, plus up to the 0.1 s between the collector's word of it). The
last line: applied events per collector
CPU-second at the busiest row that lost no event, the backends at `--rate` each that
one core follows at that pace, and the largest fleet whose events were applied as fast
as they came (on a host with fewer cores than the router and the generator need, the
host limits that one).

Reproduces docs/performance.md, "KV events at fleet rate".

    python -m bench.studies.event_rate --backends 16,64,128,256 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import uvloop
import zmq.asyncio

from bench.harness import processes, procstat
from bench.harness.compare import router_config
from bench.sim.kv_events import MEDIUM_GPU, BlockRemoved, BlockStored, KVEvent
from bench.sim.publisher import KVEventPublisher
from bench.studies import instant_backend

#: blocks per chain: every this many stores, a new chain starts at the root
_CHAIN = 8
#: batches each publisher keeps for replay (vLLM's default is 10000; a few seconds here)
_REPLAY_STEPS = 100
_PUB_HWM = 100_000
_DRAIN_SECONDS = 20.0
_POLL_SECONDS = 0.5
_DRAIN_POLL_SECONDS = 0.25
_KEPT_UP = 0.95  # applied/offered at or above which a row kept up (the count is polled)
_APPLIED = b"kvroute_kv_events_applied_total"


# --- the generator: fake backends, in a child process -------------------------------


@dataclass
class _Stream:
    """One backend's events: a steady window of chained blocks, slid one block per
    store/remove pair. Hashes and tokens repeat after twice the window (removed by then)."""

    ordinal: int
    window: int
    block_size: int
    next_block: int = 0

    def _hash(self, block: int) -> int:
        return (self.ordinal << 40) | (block % (2 * self.window)) + 1

    def events(self, pairs: int) -> list[KVEvent]:
        out: list[KVEvent] = []
        bs = self.block_size
        for _ in range(pairs):
            i = self.next_block
            self.next_block += 1
            parent = None if i % _CHAIN == 0 else self._hash(i - 1)
            first = (self.ordinal * 2 * self.window + i % (2 * self.window)) * bs
            tokens = list(range(first, first + bs))
            out.append(BlockStored([self._hash(i)], parent, tokens, bs, None, MEDIUM_GPU, None))
            if i >= self.window:
                out.append(BlockRemoved([self._hash(i - self.window)], MEDIUM_GPU))
        return out


async def _generate(args: argparse.Namespace) -> None:
    """Serve the backends, announce them, then publish for each `go SECONDS` line."""
    ctx = zmq.asyncio.Context()
    loop = asyncio.get_running_loop()
    paces = {instant_backend.MODEL: instant_backend.Pace(0.0, 0)}
    pubs, streams = [], []
    for n in range(args.count):
        server = await loop.create_server(lambda: instant_backend.RawHTTP(paces, 1), "127.0.0.1", 0)
        pub = KVEventPublisher(
            ctx, host="127.0.0.1", pub_port=0, replay_port=0, topic="",
            encoding=args.encoding, buffer_steps=_REPLAY_STEPS, hwm=_PUB_HWM,
        )  # fmt: skip
        port = server.sockets[0].getsockname()[1]
        print(f"http://127.0.0.1:{port} {pub.endpoint} {pub.replay_endpoint}", flush=True)
        pubs.append(pub)
        streams.append(_Stream(args.first + n, args.window, args.block_size))
    await asyncio.gather(*(p.subscribed.wait() for p in pubs))
    print("subscribed", flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        sent = await _publish(pubs, streams, args.rate, args.interval, float(line.split()[1]))
        print(msgspec.json.encode(sent).decode(), flush=True)


async def _publish(
    pubs: Sequence[KVEventPublisher],
    streams: Sequence[_Stream],
    rate: float,
    interval: float,
    seconds: float,
) -> dict[str, float]:
    """Publish `rate` events a second per backend for `seconds`, one batch per backend
    every `interval` (a late tick is skipped, not made up for: the offered rate is what
    was sent). Returns the events sent and when the last batch went."""
    pairs = max(1, round(rate * interval / 2))
    loop = asyncio.get_running_loop()
    start = due = loop.time()
    events = late = 0
    while (now := loop.time()) < start + seconds:
        if now > due + interval:
            late += 1
            due = now
        for pub, stream in zip(pubs, streams, strict=True):
            batch = stream.events(pairs)
            events += len(batch)
            await pub.publish(batch)
        due += interval
        await asyncio.sleep(max(0.0, due - loop.time()))
    return {"events": events, "seconds": loop.time() - start, "late_ticks": late, "at": time.time()}


# --- the driver -------------------------------------------------------------------------


@dataclass
class Row:
    backends: int
    offered: float  # events/s sent
    applied: float  # events/s counted in the window
    collector_cpu: float  # share of one core
    workers_cpu: float  # the rest of the router: its workers (and supervisor), summed
    generator_cpu: float  # the fake backends
    complete: float  # applied / sent, once drained
    lag_p50_ms: float | None
    lag_p99_ms: float | None

    @property
    def kept_up(self) -> bool:
        return self.applied >= _KEPT_UP * self.offered and self.complete >= _KEPT_UP


class _Generator:
    """One generator child: its backends' configs, and `go` to publish."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def line(self) -> bytes:
        assert self.proc.stdout is not None
        async with asyncio.timeout(60):
            line = await self.proc.stdout.readline()
        if not line:
            raise processes.StartFailed("the event generator exited")
        return line

    async def go(self, seconds: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"go {seconds}\n".encode())
        await self.proc.stdin.drain()


@contextlib.asynccontextmanager
async def _generators(
    args: argparse.Namespace, backends: int
) -> AsyncIterator[tuple[list[_Generator], list[dict]]]:
    """`backends` fake backends over `--generators` children; their router configs."""
    n = min(args.generators, backends)
    shares = [backends // n + (i < backends % n) for i in range(n)]
    gens: list[_Generator] = []
    configs: list[dict] = []
    try:
        first = 0
        for share in shares:
            cmd = [sys.executable, "-m", "bench.studies.event_rate", "--generator", str(share),
                   "--first", str(first), "--rate", str(args.rate),
                   "--interval", str(args.interval), "--window", str(args.window),
                   "--block-size", str(args.block_size), "--encoding", args.encoding]  # fmt: skip
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
            )
            gens.append(_Generator(proc))
            for i in range(first, first + share):
                url, pub, replay = (await gens[-1].line()).decode().split()
                kv = {"endpoint": pub, "replay_endpoint": replay}
                configs.append({"url": url, "name": f"ev-{i}", "kv_events": kv})
            first += share
        yield gens, configs
    finally:
        for gen in gens:
            await processes.stop(gen.proc)


async def _applied(http: aiohttp.ClientSession, url: str) -> float:
    """The router's kvroute_kv_events_applied_total, all kinds."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.read()
    lines = text.splitlines()
    return sum(float(line.rsplit(b" ", 1)[1]) for line in lines if line.startswith(_APPLIED))


async def _ages(
    http: aiohttp.ClientSession, url: str, stop: asyncio.Event, since: float
) -> list[float]:
    """Until `stop`: the age of each backend's newest batch a worker shows, in seconds,
    once it is one published `since` (wall clock) on: a batch of the warm-up, before the
    generators paused, says nothing of the measured window."""
    ages: list[float] = []
    while not stop.is_set():
        async with http.get(url + "/debug/routing") as resp:
            state = await resp.json()
        now = time.time()
        ages += [now - b["events_published"] for b in state["backends"].values()
                 if (b.get("events_published") or 0) >= since]  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _POLL_SECONDS)
    return ages


def _collector(root: int) -> int:
    """The collector's pid in the router's process tree (the router alone: itself)."""
    for pid in procstat.tree(root):
        with contextlib.suppress(OSError):
            if b"kvroute: collector" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return root


async def measure(args: argparse.Namespace, backends: int) -> Row:
    """One row: a fresh router in front of `backends` fake ones, warmed, then measured."""
    async with contextlib.AsyncExitStack() as stack:
        gens, configs = await stack.enter_async_context(_generators(args, backends))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        knobs = {"block_size": args.block_size}
        config = router_config("KV_AWARE", configs, knobs, args.workers)
        cmd = processes.kvroute_serve(config, tmp / "router.yaml")
        routers = processes.replicas(lambda port: [*cmd, "--port", str(port)], "/ready", 1)
        ((url, pid),) = await stack.enter_async_context(routers)
        http = await stack.enter_async_context(aiohttp.ClientSession())
        for gen in gens:
            while (await gen.line()).strip() != b"subscribed":
                pass
        warm = args.window / (args.rate / 2)  # the window filled: removals flow
        await _run(gens, warm)
        # the warm-up's backlog, counted (the counter lags by up to a tenth of a second)
        await _drain(http, url, await _applied(http, url), math.inf)
        return await _measured(args, backends, gens, http, url, pid)


async def _run(gens: Sequence[_Generator], seconds: float) -> list[dict]:
    for gen in gens:
        await gen.go(seconds)
    return [msgspec.json.decode(await gen.line()) for gen in gens]


async def _measured(
    args: argparse.Namespace,
    backends: int,
    gens: Sequence[_Generator],
    http: aiohttp.ClientSession,
    url: str,
    pid: int,
) -> Row:
    before = await _applied(http, url)
    stop = asyncio.Event()
    ages = asyncio.create_task(_ages(http, url, stop, time.time()))
    collector, generators = _collector(pid), [gen.proc.pid for gen in gens]
    groups = {
        "collector": [collector],
        "workers": [p for p in procstat.tree(pid) if p != collector],
        "generator": generators,
    }
    with procstat.cpu_meter(groups) as cpu:
        t0 = time.monotonic()
        sent = await _run(gens, args.seconds)
        window = time.monotonic() - t0
        events = sum(s["events"] for s in sent)
        applied, done = await _drain(http, url, before, events)
    stop.set()
    samples = await ages
    return Row(
        backends=backends,
        offered=events / window,
        applied=applied / max(window, done - t0),
        collector_cpu=cpu.get("collector", float("nan")),
        workers_cpu=cpu.get("workers", float("nan")),
        generator_cpu=cpu.get("generator", float("nan")),
        complete=applied / events if events else 1.0,
        lag_p50_ms=_quantile(samples, 0.5),
        lag_p99_ms=_quantile(samples, 0.99),
    )


async def _drain(
    http: aiohttp.ClientSession, url: str, before: float, events: float
) -> tuple[float, float]:
    """Events applied since `before`, and when (monotonic): once all `events` are, or
    the count stopped growing for a second (`math.inf`: only then)."""
    deadline = time.monotonic() + _DRAIN_SECONDS
    last, since = -1.0, time.monotonic()
    while (now := time.monotonic()) < deadline:
        applied = await _applied(http, url) - before
        if applied >= events:
            return applied, time.monotonic()
        if applied != last:
            last, since = applied, now
        elif now - since >= 1.0:
            break
        await asyncio.sleep(_DRAIN_POLL_SECONDS)
    return last, since


def _quantile(samples: list[float], q: float) -> float | None:
    if len(samples) < 2:
        return None
    return statistics.quantiles(samples, n=100)[round(q * 100) - 1] * 1000


def table(rows: Sequence[Row], rate: float) -> str:
    """The rows, then what one collector core follows (from the fastest row that kept up)."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    lines = [
        "| backends | offered ev/s | applied ev/s | collector CPU % | workers CPU % | "
        "generator CPU % | applied/sent | lag P50 ms | lag P99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.backends} | {r.offered:,.0f} | {r.applied:,.0f} | {r.collector_cpu * 100:.0f} "
            f"| {r.workers_cpu * 100:.0f} | {r.generator_cpu * 100:.0f} | {r.complete:.3f} "
            f"| {ms(r.lag_p50_ms)} | {ms(r.lag_p99_ms)} |"
        )
    lines.append("")
    lines.append(one_core(rows, rate))
    return "\n".join(lines)


def one_core(rows: Sequence[Row], rate: float) -> str:
    """Applied events per collector CPU-second at the busiest row that lost nothing (a
    collector behind works flat out on the CPU it gets), the backends publishing `rate`
    a second that one core follows at that pace, and the fleets kept up with live."""
    whole = [r for r in rows if r.complete >= _KEPT_UP and r.collector_cpu > 0]
    if not whole:
        return "one core: every row lost events"
    best = max(whole, key=lambda r: r.applied)
    per_core = best.applied / best.collector_cpu
    live = max((r.backends for r in rows if r.kept_up), default=0)
    return (
        f"one core: {per_core:,.0f} events/s per collector CPU-second (at {best.backends} "
        f"backends) -> {int(per_core // rate)} backends at {rate:,.0f} events/s each; "
        f"kept up live with up to {live} backends on this host"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Fleets of hundreds of backends need many ports: check `ulimit -n`.",
    )
    parser.add_argument("--backends", default="16,64,128,256", help="fleet sizes, one row each")
    parser.add_argument("--rate", type=float, default=1000.0, help="events/s per backend")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between batches")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per row")
    parser.add_argument("--workers", type=int, default=0, help="0: one per core")
    parser.add_argument("--generators", type=int, default=1, help="generator processes")
    parser.add_argument("--window", type=int, default=1024, help="blocks each backend holds")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--encoding", choices=("map", "array"), default="map",
                        help="event form: map (vLLM >=0.24) or array (<=0.23)")  # fmt: skip
    parser.add_argument("--generator", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.generator is not None:
        args.count = args.generator
        uvloop.run(_generate(args))
        return 0
    rows = []
    for n in (int(b) for b in args.backends.split(",")):
        rows.append(uvloop.run(measure(args, n)))
        print(table(rows[-1:], args.rate).splitlines()[2], flush=True)
    print(table(rows, args.rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
