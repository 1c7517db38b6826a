"""`kvroute bench`: replay one workload against each routing strategy and compare them.

For each strategy in turn, on a fresh, cold fleet so that the runs are comparable:
  1. start K simulated vLLM servers in one child process (`python -m bench.sim`);
  2. start a router with that strategy in a process of its own (`kvroute serve`);
  3. calibrate the router's hop: pairs of `POST /tokenize` direct to a backend, then
     through the router (proxying only, no engine work); hop = median difference;
  4. snapshot every backend's /metrics and /sim/stats and the router's /metrics;
  5. replay the workload through the router (`bench.loadgen`), bounded by --max-wall;
  6. snapshot again: the deltas give the fleet hit rate, load spread and decision time;
  7. stop the router, then the fleet (in `finally`: also on errors and Ctrl-C).
With --target URL nothing is started: the workload goes to URL, and hit rate and spread
come from what it exposes (kvroute's x-kvroute-backend header, vLLM's /metrics,
usage.cached_tokens), n/a otherwise.

Process layout on 2 cores. The simulator is the CPU-heavy part: it tokenizes every
prompt (~5 ms of Python per 8k-token request), runs every engine step of K backends and
writes every SSE chunk, so it gets a process, hence a core, of its own, and its clock
(the engine's step sleeps) never waits behind the client. The router gets a process of
its own too, as in production: in the load generator's process, KV_AWARE's tokenizing
and KV event handling ran on the loop that timestamps every chunk, which no deployment
does. What does distort results on a shared 2-core machine is everything else running:
time_scale 0.25 inflated PREFIX_AWARE's cached TTFTs (P50 124-468 ms simulated against 64
at time_scale 1), while 0.5 (the default, ~25% of a core each) agreed with 1 within
~20 ms. The footer prints each
process's CPU share and this event loop's lag, and warns when the lag is large in
simulated time; compare a slower --time-scale when in doubt.

Every run is bounded: --requests, --duration and --max-wall per strategy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import aiohttp
import msgspec
import orjson
import uvloop

import policies
from bench import procstat, scrape
from bench.loadgen import Outcome, replay
from bench.overhead import free_port, wait_ready
from bench.report import BackendDelta, Run, Summary, chart, percentile, reading, summarize, table
from bench.workloads import SHAPES, RequestSpec, WorkloadSpec, generate
from router.config import Config, build

__all__ = ["Options", "build_parser", "main", "router_config", "run_bench"]

DEFAULT_STRATEGIES = ("RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE")
DEFAULT_RATE = 6.0  # requests per simulated second: busy, not saturated, for 7 backends
DEFAULT_TIME_SCALE = 0.5
_SIM_START_SECONDS = 30.0
_ROUTER_START_SECONDS = 30.0
_STOP_SECONDS = 10.0
_LAG_TICK = 0.01
_LAG_WARNING = 0.05  # simulated seconds of event-loop lag (p99) that distort small TTFTs
_WARMUP_PAIRS = 5
_HTTP_TIMEOUT = aiohttp.ClientTimeout(total=30)


class HarnessError(RuntimeError):
    """The benchmark cannot run (a process did not start, a target did not answer)."""


_EXAMPLES = """examples:
  # issue 3's benchmark: the public long-context shape (7 instances, 8,000-token prefixes)
  kvroute bench --workload long-prefix --backends 7 --requests 300 --groups 50 --rate 6 \\
      --time-scale 1 --out results/
  # a hot prefix: does the concurrency threshold spread it?
  kvroute bench --workload hot-prefix --strategies PREFIX_AWARE --concurrency-threshold 8
  # KV_AWARE with the simulator's KV events
  kvroute bench --strategies PREFIX_AWARE,KV_AWARE --sim-arg=--kv-events
  # the same workload against a router (or vLLM) that is already running
  kvroute bench --target http://127.0.0.1:8000 --rate 2 --requests 100
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' lines; shows a default only where there is one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == [] or action.default == argparse.SUPPRESS:
            return action.help
        return f"{action.help} (default: {action.default})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute bench",
        description=(
            "Replay the same seeded workload against each routing strategy, each on a fresh,\n"
            "cold fleet of simulated vLLM servers behind a kvroute router, and print one\n"
            "comparison table. Latencies are in simulated time (wall time / --time-scale)."
        ),
        epilog=_EXAMPLES,
        formatter_class=_HelpFormatter,
    )
    run = p.add_argument_group("what to compare")
    run.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help=f"comma-separated; the first is the baseline. Known: {', '.join(policies.names())}",
    )
    run.add_argument("--backends", type=_positive(int), default=7, help="simulated vLLM servers")
    run.add_argument(
        "--time-scale",
        type=_positive(float),
        help="simulated durations x this (0.5 = twice as fast as real hardware); default "
        f"{DEFAULT_TIME_SCALE:g}, or 1 with --target (give a simulated target's own scale)",
    )
    run.add_argument(
        "--sim-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass to the simulator, e.g. --sim-arg=--num-gpu-blocks=12000 (see kvroute sim -h)",
    )
    run.add_argument(
        "--prefix-length", type=_positive(int), help="router prefix_length (PREFIX_AWARE)"
    )
    run.add_argument(
        "--concurrency-threshold",
        type=_positive(int),
        help="router concurrency_threshold (PREFIX_AWARE)",
    )
    run.add_argument(
        "--target",
        metavar="URL",
        help="send the workload to this router or server instead (e.g. http://127.0.0.1:8000); "
        "starts nothing and ignores --strategies",
    )
    run.add_argument("--model", help="model name to request (default: the target's first model)")
    work = p.add_argument_group("workload (bench/workloads.py)")
    work.add_argument(
        "--workload",
        choices=sorted(SHAPES),
        default="long-prefix",
        help="long-prefix: shared 8,000-token documents + own questions; short-prefix: the "
        "same with 500 tokens; hot-prefix: documents drawn by a Zipf law; multi-turn: "
        "conversations resent whole each turn; no-sharing: unique prompts",
    )
    work.add_argument("--requests", type=int, default=300, help="requests per strategy")
    work.add_argument("--groups", type=int, default=50, help="prefix groups / conversations")
    work.add_argument(
        "--prefix-tokens", type=int, help="shared prompt length (default: the shape's)"
    )
    work.add_argument("--question-tokens", type=int, default=100, help="per-request question")
    work.add_argument("--max-tokens", type=int, default=100, help="output tokens per request")
    work.add_argument("--zipf-s", type=float, default=1.1, help="hot-prefix Zipf exponent")
    work.add_argument("--seed", type=int, default=0, help="workload and policy seed")
    arrivals = work.add_mutually_exclusive_group()
    arrivals.add_argument(
        "--rate",
        type=_positive(float),
        help=f"Poisson arrivals per simulated second (default: {DEFAULT_RATE:g})",
    )
    arrivals.add_argument(
        "--concurrency", type=_positive(int), help="closed loop with this many clients"
    )
    work.add_argument("--duration", type=float, help="stop Poisson arrivals after this (sim s)")
    out = p.add_argument_group("bounds and output")
    out.add_argument(
        "--max-wall",
        type=_positive(float),
        default=600.0,
        help="wall seconds per strategy, then cancel",
    )
    out.add_argument(
        "--calibration",
        type=_non_negative,
        default=40,
        help="direct/routed pairs for the hop cost (0: skip)",
    )
    out.add_argument("--out", type=Path, metavar="DIR", help="write results.json and a PNG")
    return p


def _positive(kind: type) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


class Options(NamedTuple):
    """How to run the benchmark, besides the workload."""

    strategies: list[str]
    backends: int
    time_scale: float
    sim_args: list[str]
    routing: dict[str, int]
    target: str | None
    model: str | None
    concurrency: int | None
    max_wall: float
    calibration: int


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        workload, options = _from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    specs = generate(workload)
    try:
        runs = uvloop.run(_until_signal(run_bench(specs, options, _progress_factory())))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("\nkvroute bench: interrupted; everything started was stopped", file=sys.stderr)
        return 130
    except HarnessError as exc:
        print(f"kvroute bench: {exc}", file=sys.stderr)
        return 1
    summaries = [summarize(r) for r in runs]
    print(_header(workload, options, len(specs)))
    print(table(summaries))
    for line in [*reading(summaries), *_footer(runs, options)]:
        print(line)
    if args.out is not None:
        _write(args.out, argv, workload, options, runs, summaries)
    return 0 if all(s.ok for s in summaries) else 1  # 1: a strategy served nothing


def _from_args(args: argparse.Namespace) -> tuple[WorkloadSpec, Options]:
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in policies.names()]
    if unknown or not strategies:
        raise ValueError(f"unknown strategies {unknown}; known: {', '.join(policies.names())}")
    fields = {
        "shape": args.workload,
        "requests": args.requests,
        "groups": args.groups,
        "prefix_tokens": args.prefix_tokens,
        "question_tokens": args.question_tokens,
        "max_tokens": args.max_tokens,
        "zipf_s": args.zipf_s,
        "rate": None if args.concurrency else (args.rate or DEFAULT_RATE),
        "duration": args.duration,
        "seed": args.seed,
    }
    try:
        workload = msgspec.convert(fields, WorkloadSpec)  # checks the bounds
    except msgspec.ValidationError as exc:  # "... - at `$.prefix_tokens`" -> --prefix-tokens
        flag = re.sub(r"\$\.(\w+)", lambda m: "--" + m[1].replace("_", "-"), str(exc))
        raise ValueError(flag.replace("--shape", "--workload")) from None
    knobs = {
        "seed": args.seed,
        "prefix_length": args.prefix_length,
        "concurrency_threshold": args.concurrency_threshold,
    }
    options = Options(
        strategies=["target"] if args.target else strategies,
        backends=args.backends,
        time_scale=args.time_scale or (1.0 if args.target else DEFAULT_TIME_SCALE),
        sim_args=args.sim_arg,
        routing={k: v for k, v in knobs.items() if v is not None},
        target=args.target.rstrip("/") if args.target else None,
        model=args.model,
        concurrency=args.concurrency,
        max_wall=args.max_wall,
        calibration=args.calibration,
    )
    return workload, options


async def _until_signal(work: Awaitable[list[Run]]) -> list[Run]:
    """Await `work`; SIGTERM cancels it like Ctrl-C does, so every `finally` still runs."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await work


async def run_bench(
    specs: Sequence[RequestSpec], options: Options, progress: _ProgressFactory | None = None
) -> list[Run]:
    """One `Run` per strategy (or one for --target), in order."""
    runs = []
    for strategy in options.strategies:
        on_done = progress(strategy, len(specs)) if progress else _ignore
        if options.target is None:
            runs.append(await _simulated_run(strategy, specs, options, on_done))
        else:
            runs.append(await _target_run(options.target, specs, options, on_done))
    return runs


async def _simulated_run(
    strategy: str, specs: Sequence[RequestSpec], options: Options, on_done: _OnDone
) -> Run:
    async with _simulator(options) as (backends, sim_pid):
        urls = [b["url"] for b in backends]
        config = router_config(strategy, backends, options.routing)
        async with _router(config) as (url, router_pid):
            async with aiohttp.ClientSession(timeout=_HTTP_TIMEOUT) as http:
                model = options.model or await _first_model(http, url)
                hop = await _calibrate(http, urls, url, model, options.calibration)
                pids = {"harness": os.getpid(), "simulator": sim_pid, "router": router_pid}
                entry = _Entry(strategy, url, urls, pids, hop)
                return await _measured_replay(http, entry, model, specs, options, on_done)


async def _target_run(
    target: str, specs: Sequence[RequestSpec], options: Options, on_done: _OnDone
) -> Run:
    async with aiohttp.ClientSession(timeout=_HTTP_TIMEOUT) as http:
        model = options.model or await _first_model(http, target)
        entry = _Entry(None, target, [], {"harness": os.getpid()}, None)
        return await _measured_replay(http, entry, model, specs, options, on_done)


class _Entry(NamedTuple):
    """Where a replay goes and what is known around it."""

    strategy: str | None  # None: ask the target (kvroute's decision counter)
    url: str
    backends: list[str]  # simulated backends to snapshot; empty for a target
    pids: dict[str, int]  # processes whose CPU share is measured
    hop: float | None


async def _measured_replay(
    http: aiohttp.ClientSession,
    entry: _Entry,
    model: str,
    specs: Sequence[RequestSpec],
    options: Options,
    on_done: _OnDone,
) -> Run:
    """Snapshot, replay through `entry`, snapshot; the Run with every delta."""
    before = await _snapshot(http, entry.url, entry.backends)
    started = time.monotonic()
    with procstat.cpu_meter(entry.pids) as cpu:
        async with _lag_monitor() as lags:
            outcomes = await replay(
                entry.url,
                model,
                specs,
                concurrency=options.concurrency,
                time_scale=options.time_scale,
                deadline=options.max_wall,
                on_done=on_done,
            )
    wall = time.monotonic() - started
    after = await _snapshot(http, entry.url, entry.backends)
    r0, r1 = before.router, after.router
    return Run(
        strategy=entry.strategy or scrape.reported_strategy(r1) or "target",
        time_scale=options.time_scale,
        wall_seconds=wall,
        outcomes=outcomes,
        backends=_backend_deltas(before, after, entry.backends, outcomes),
        decision_seconds_sum=scrape.delta(r0, r1, "kvroute_routing_decision_seconds_sum"),
        decision_buckets=scrape.bucket_deltas(r0, r1, "kvroute_routing_decision_seconds_bucket"),
        hop_seconds=entry.hop,
        loop_lag_p99=percentile(lags, 0.99),
        cpu=cpu,
    )


# --- processes ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _simulator(options: Options) -> AsyncIterator[tuple[list[dict], int]]:
    """K simulated servers in a child process; yields their backend configs and its pid."""
    cmd = [sys.executable, "-m", "bench.sim", "--backends", str(options.backends)]
    cmd += ["--time-scale", str(options.time_scale), "--host", "127.0.0.1", *options.sim_args]
    kv_events = "--kv-events" in options.sim_args
    with tempfile.TemporaryFile() as stderr:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=stderr
        )
        try:
            yield await _announced(proc, options.backends, kv_events, stderr), proc.pid
        finally:
            await _stop(proc)


@contextlib.asynccontextmanager
async def _router(config: Config) -> AsyncIterator[tuple[str, int]]:
    """`kvroute serve` with `config` in a process of its own, as in production: its work
    (parsing, tokenizing, KV events) never holds up the load generator's clock. Yields
    its URL and pid."""
    data = msgspec.to_builtins(config)
    data["listen"]["port"] = port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (
        tempfile.TemporaryDirectory(prefix="kvroute-bench-") as tmp,
        tempfile.TemporaryFile() as err,
    ):
        path = Path(tmp) / "router.yaml"
        path.write_bytes(orjson.dumps(data))  # JSON is YAML
        cmd = [sys.executable, "-m", "router", "serve", "-c", str(path), "--workers", "1"]
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=err
        )
        try:
            try:
                await wait_ready(url, _ROUTER_START_SECONDS)
            except RuntimeError:
                err.seek(0)
                tail = err.read().decode(errors="replace").strip().splitlines()[-5:]
                raise HarnessError("the router did not start:\n  " + "\n  ".join(tail)) from None
            yield url, proc.pid
        finally:
            await _stop(proc)


async def _announced(
    proc: asyncio.subprocess.Process, n: int, kv_events: bool, stderr
) -> list[dict]:
    """Backend configs from the simulator's stdout: n URL lines, then with --kv-events n
    lines `kv-events URL pub=ENDPOINT replay=ENDPOINT` (bench/sim/cli.py)."""
    assert proc.stdout is not None
    lines: list[str] = []
    expected = 2 * n if kv_events else n
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_SIM_START_SECONDS):
            while len(lines) < expected and (line := await proc.stdout.readline()):
                lines.append(line.decode().strip())
    if len(lines) < expected:
        stderr.seek(0)
        tail = stderr.read().decode(errors="replace").strip().splitlines()[-5:]
        raise HarnessError("the simulator did not start:\n  " + "\n  ".join(tail or ["?"]))
    # fixed names: the hash ring, hence each prefix's home, is the same in every run
    backends = [{"url": url, "name": f"sim-{i}"} for i, url in enumerate(lines[:n])]
    for backend, line in zip(backends, lines[n:], strict=False):
        fields = dict(field.split("=", 1) for field in line.split()[2:])
        backend["kv_events"] = {"endpoint": fields["pub"], "replay_endpoint": fields["replay"]}
    return backends


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), _STOP_SECONDS)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def router_config(strategy: str, backends: list[dict], knobs: dict[str, int]) -> Config:
    """A router on a free port of 127.0.0.1 with `strategy` and the knobs it has."""
    fields = policies.policy_class(strategy).params_type.__struct_fields__
    routing = {"strategy": strategy, **{k: v for k, v in knobs.items() if k in fields}}
    return build(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "backends": backends,
            "routing": routing,
            "log_level": "warning",
        },
        "kvroute bench",
    )


# --- measurements ---------------------------------------------------------------------


async def _first_model(http: aiohttp.ClientSession, url: str) -> str:
    try:
        async with http.get(url + "/v1/models") as resp:
            data = (await resp.json()).get("data") or []
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise HarnessError(f"{url}/v1/models did not answer: {exc}") from exc
    if not data:
        raise HarnessError(f"{url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


async def _calibrate(
    http: aiohttp.ClientSession, backends: list[str], router: str, model: str, pairs: int
) -> float | None:
    """Median of (routed - direct) over back-to-back `POST /tokenize` pairs; None for 0 pairs.

    Pairing adjacent calls cancels the machine's slow drifts (other processes' load).
    """
    if pairs == 0:
        return None
    body = orjson.dumps({"model": model, "prompt": "calibration"})

    async def timed(url: str) -> float:
        t0 = time.perf_counter()
        async with http.post(url + "/tokenize", data=body) as resp:
            await resp.read()
        return time.perf_counter() - t0

    differences = []
    for i in range(pairs + _WARMUP_PAIRS):
        direct = await timed(backends[i % len(backends)])
        routed = await timed(router)
        if i >= _WARMUP_PAIRS:
            differences.append(routed - direct)
    return percentile(differences, 0.5)


class _Snapshot(NamedTuple):
    router: scrape.Samples
    backends: list[tuple[scrape.Samples, dict]]  # /metrics and /sim/stats of each backend


async def _snapshot(http: aiohttp.ClientSession, entry: str, backends: list[str]) -> _Snapshot:
    async def backend(url: str) -> tuple[scrape.Samples, dict]:
        return await scrape.metrics(http, url), await scrape.json_of(http, url + "/sim/stats")

    router, *rest = await asyncio.gather(scrape.metrics(http, entry), *map(backend, backends))
    return _Snapshot(router, list(rest))


def _backend_deltas(
    before: _Snapshot, after: _Snapshot, urls: list[str], outcomes: list[Outcome]
) -> list[BackendDelta]:
    """Simulated fleet: each backend's counters. Target: what the target itself exposes."""
    if not urls:
        return _target_deltas(before.router, after.router, outcomes)
    out = []
    for url, (m0, s0), (m1, s1) in zip(urls, before.backends, after.backends, strict=True):
        out.append(
            BackendDelta(
                name=url,
                requests=scrape.stat_delta(s0, s1, "requests_received"),
                busy_seconds=scrape.stat_delta(s0, s1, "busy_seconds"),
                prefix_hits=scrape.delta(m0, m1, "vllm:prefix_cache_hits_total"),
                prefix_queries=scrape.delta(m0, m1, "vllm:prefix_cache_queries_total"),
            )
        )
    return out


def _target_deltas(
    before: scrape.Samples, after: scrape.Samples, outcomes: list[Outcome]
) -> list[BackendDelta]:
    hits = scrape.delta(before, after, "vllm:prefix_cache_hits_total")
    if hits is not None:  # the target is one vLLM server
        queries = scrape.delta(before, after, "vllm:prefix_cache_queries_total")
        delta = BackendDelta(name="target", prefix_hits=hits, prefix_queries=queries)
        return [delta]
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.backend:
            counts[o.backend] = counts.get(o.backend, 0) + 1
    return [BackendDelta(name=name, requests=n) for name, n in sorted(counts.items())]


@contextlib.asynccontextmanager
async def _lag_monitor() -> AsyncIterator[list[float]]:
    """How late this event loop wakes a 10 ms timer, sampled for the block's duration."""
    lags: list[float] = []
    loop = asyncio.get_running_loop()

    async def tick() -> None:
        while True:
            t0 = loop.time()
            await asyncio.sleep(_LAG_TICK)
            lags.append(loop.time() - t0 - _LAG_TICK)

    task = asyncio.create_task(tick())
    try:
        yield lags
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --- output ---------------------------------------------------------------------------

_OnDone = Callable[[Outcome], None]
_ProgressFactory = Callable[[str, int], _OnDone]


def _ignore(outcome: Outcome) -> None:
    pass


def _progress_factory() -> _ProgressFactory | None:
    """A `\\r` progress line per strategy on stderr, only when stderr is a terminal."""
    return _Progress if sys.stderr.isatty() else None


class _Progress:
    _EVERY = 0.2  # seconds between redraws

    def __init__(self, label: str, total: int) -> None:
        self._label, self._total = label, total
        self._ok = self._failed = 0
        self._t0 = self._drawn = time.monotonic()

    def __call__(self, outcome: Outcome) -> None:
        if outcome.ok:
            self._ok += 1
        else:
            self._failed += 1
        done = self._ok + self._failed
        now = time.monotonic()
        if now - self._drawn < self._EVERY and done < self._total:
            return
        self._drawn = now
        width = 30
        bar = "#" * (width * done // self._total)
        sys.stderr.write(
            f"\r{self._label:28} [{bar:{width}}] {done}/{self._total} "
            f"failed {self._failed}  {now - self._t0:5.1f} s"
        )
        if done == self._total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _header(workload: WorkloadSpec, options: Options, n: int) -> str:
    w = workload
    if w.shape == "no-sharing":
        prompts = f"unique {w.shared_tokens + w.question_tokens}-token prompts"
    else:
        prompts = (
            f"{w.groups} groups, {w.shared_tokens}-token shared prompts, "
            f"{w.question_tokens}-token questions"
        )
    if options.concurrency:
        arrivals = f"closed loop, {options.concurrency} clients"
    else:
        arrivals = f"Poisson {w.rate:g} req/s" + ("" if options.target else " (simulated)")
    if options.target:
        where = f"target {options.target}"
    else:
        where = f"{options.backends} simulated backends, time_scale {options.time_scale:g}"
    return (
        f"{w.shape}: {n} requests, {prompts}, {w.max_tokens} output tokens, {arrivals}, "
        f"seed {w.seed}; {where}"
    )


def _footer(runs: Sequence[Run], options: Options) -> list[str]:
    clock = "wall time" if options.target else "simulated time (wall / time_scale)"
    names = sorted({name for r in runs for name in r.cpu})
    shares = ", ".join(f"{n} {max(r.cpu.get(n, 0.0) for r in runs):.0%}" for n in names)
    lag = max((r.loop_lag_p99 or 0.0) for r in runs)
    lines = [
        f"Latencies (ms) and req/s are in {clock}. The router's own cost is real time: "
        "decide µs = routing decision (P50), hop ms = added proxy latency (median of "
        "direct/routed pairs).",
        f"CPU, peak share of one core over a replay: {shares or 'n/a'}; this process's event "
        f"loop lag p99 {lag * 1e3:.1f} ms.",
    ]
    if lag / options.time_scale > _LAG_WARNING:
        lines.append(
            f"WARNING: that lag is {lag / options.time_scale * 1e3:.0f} ms of simulated time: "
            "the machine is short of CPU and small latencies are inflated; use a larger "
            "--time-scale."
        )
    return lines


def _write(
    out: Path,
    argv: Sequence[str] | None,
    workload: WorkloadSpec,
    options: Options,
    runs: Sequence[Run],
    summaries: Sequence[Summary],
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": ["kvroute", "bench", *(sys.argv[1:] if argv is None else argv)],
        "workload": workload,
        "options": options._asdict(),
        "summaries": summaries,
        "runs": runs,
    }
    (out / "results.json").write_bytes(msgspec.json.encode(doc))
    if chart(runs, summaries, out / "ttft_hit_rate.png"):
        print(f"wrote {out / 'results.json'} and {out / 'ttft_hit_rate.png'}")
    else:
        print(
            f"wrote {out / 'results.json'}; matplotlib is not installed, so no PNG "
            "(pip install -e '.[bench]')"
        )


if __name__ == "__main__":
    sys.exit(main())
