"""`kvroute bench`: replay one workload against each routing strategy and compare them.

For each row in turn (each strategy, then with --peers each peer router), on a fresh,
cold fleet so that the rows are comparable:
  1. start K simulated vLLM servers in one child process (`python -m bench.sim`);
  2. start the row's router, --replicas processes of it, each on a port of its own:
     kvroute as `kvroute serve` starts by default (one worker per usable core, config
     `workers: 0`; --workers to choose), KV events only if the simulator publishes them
     (`--sim-arg=--kv-events`); or a peer with its policy and its own defaults;
  3. calibrate the router's hop: pairs of `POST /tokenize` direct to a backend, then
     through the router (proxying only, no engine work); hop = median difference (n/a
     for a router that does not proxy /tokenize);
  4. snapshot every backend's /metrics and /sim/stats and each replica's /metrics;
  5. replay the workload (`bench.harness.loadgen`), each request to a replica drawn from the
     seed, bounded by --max-wall;
  6. snapshot again: the backends' deltas give the fleet hit rate and load spread, the
     same way for every router; kvroute's own give its decision time;
  7. stop the routers, then the fleet (in `finally`: also on errors and Ctrl-C).
With --pd P:D each strategy runs a second time on P prefill and D decode backends (a
prefill and a decode pool; the simulator speaks NixlConnector's kv_transfer_params).
The peers (sglang-router with cache_aware and with round_robin, vllm-router with
cache_aware) are pip-installed on first use into bench.studies.throughput's virtualenv; one that
cannot be installed or started is a row of n/a with the reason, and the run goes on.
--seeds runs the whole comparison once per seed and adds each row's mean over them.
--speeds gives each simulated backend a speed (a mixed fleet) for every row. --knee
ramps each row's rate instead, a fresh fleet per step, to find its capacity
(bench/harness/knee.py).
With --target URL nothing is started: the workload goes to URL, and hit rate and spread
come from what it exposes (kvroute's x-kvroute-backend header, vLLM's /metrics,
usage.cached_tokens), n/a otherwise.

Process layout on 2 cores. The simulator is the CPU-heavy part: it tokenizes every
prompt (~5 ms of Python per 8k-token request), runs every engine step of K backends and
writes every SSE chunk, so it gets a process, hence a core, of its own, and its clock
(the engine's step sleeps) never waits behind the client. The router gets processes of
its own too, as in production (here its workers share the cores with everything else,
which a router beside its fleet would not): in the load generator's process, KV_AWARE's
tokenizing and KV event handling ran on the loop that timestamps every chunk, which no
deployment does. What does distort results on a shared 2-core machine is everything
else running: time_scale 0.25 inflated PREFIX_AWARE's cached TTFTs (P50 124-468 ms
simulated against 64 at time_scale 1), while 0.5 (the default, ~25% of a core each)
agreed with 1 within ~20 ms. Near a fleet's capacity 0.5 is too fast for such a host:
the simulator's steps come twice as fast in wall time, and a 4-backend fleet's knee
(about 30 requests per simulated second, 60 per wall second) took the harness, router
and simulator 155% of its 200%, so --knee runs at 1 unless told. The footer prints each
process's CPU share and this event loop's lag, and warns when the lag is large in
simulated time or a replay's processes took 75% of the host's cores; compare a slower
--time-scale when in doubt.

Every run is bounded: --requests, --duration and --max-wall per row and seed.
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
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import NamedTuple, TypeVar

import aiohttp
import msgspec
import orjson
import uvloop
import yaml

import policies
from bench.harness import knee, processes, procstat, scrape
from bench.harness.learned import LearnedSpeed, learned_speeds, speed_lines
from bench.harness.loadgen import Outcome, replay
from bench.harness.peers import PEERS_VENV, Peer, find_peers, peer_cmd
from bench.harness.report import (
    BackendDelta,
    Run,
    Setup,
    Summary,
    chart,
    counted,
    legend,
    means_table,
    percentile,
    reading,
    seed_means,
    summarize,
    table,
)
from bench.harness.workloads import SHAPES, RequestSpec, WorkloadSpec, generate
from router.config import DEFAULT_STRATEGY, Config, ConfigError, build
from router.control.supervisor import usable_cores, worker_count

__all__ = [
    "Options",
    "Peer",
    "add_workload_options",
    "build_parser",
    "find_peers",
    "main",
    "positive",
    "router_config",
    "run_bench",
    "workload_spec",
]

#: the baseline first; the strategy `kvroute serve` routes with by default is in every
#: default table, so the comparison shows what a user gets without choosing
DEFAULT_STRATEGIES = tuple(
    dict.fromkeys(("RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE", DEFAULT_STRATEGY))
)
DEFAULT_BACKENDS = 7
DEFAULT_RATE = 6.0  # requests per simulated second: busy, not saturated, for 7 backends
#: the label suffix of a row whose replicas share through Redis (--cluster)
CLUSTERED = "+cluster"
DEFAULT_TIME_SCALE = 0.5
_LAG_TICK = 0.01
_LAG_WARNING = 0.05  # simulated seconds of event-loop lag (p99) that distort small TTFTs
#: a replay whose processes took this share of the host's cores measured the host too
_HOST_BUSY = 0.75
_WARMUP_PAIRS = 5
_HTTP_TIMEOUT = aiohttp.ClientTimeout(total=30)
#: how long a replay whose requests failed waits for the process that caused it to be
#: seen exiting (the failures can come first)
_EXIT_GRACE_S = 2.0
#: starts the note of a row that failed because a process of its fleet exited
FAILED = "failed: "
_T = TypeVar("_T")


class HarnessError(RuntimeError):
    """The benchmark cannot run (a process did not start, a target did not answer)."""


_EXAMPLES = """examples:
  # the public long-context benchmark's shape (7 instances, 8,000-token prefixes)
  kvroute bench --workload long-prefix --backends 7 --requests 300 --groups 50 --rate 6 \\
      --time-scale 1 --out results/
  # a hot prefix: does the concurrency threshold spread it?
  kvroute bench --workload hot-prefix --strategies PREFIX_AWARE --concurrency-threshold 8
  # KV_AWARE with the simulator's KV events
  kvroute bench --strategies PREFIX_AWARE,KV_AWARE --sim-arg=--kv-events
  # beside sglang-router and vllm-router, two router replicas each, over three seeds
  kvroute bench --backends 4 --strategies PREFIX_AWARE,KV_AWARE --peers --replicas 2 \\
      --seeds 0,1,2
  # prefill/decode disaggregation: 2 prefill + 2 decode backends beside 4 combined
  kvroute bench --pd 2:2 --strategies KV_AWARE --requests 100 --groups 20 --rate 2
  # each row's capacity: the highest rate whose TTFT P90 stays under 1 s, beside the peers
  kvroute bench --knee --workload long-prefix --backends 4 --peers --seed 0
  # a mixed fleet: two backends at half speed, every row on it
  kvroute bench --backends 4 --speeds 1,1,0.5,0.5 --strategies PREFIX_AWARE,KV_AWARE --peers
  # the same workload against a router (or vLLM) that is already running
  kvroute bench --target http://127.0.0.1:8000 --rate 2 --requests 100
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' lines; shows a default only where there is one (not for flags)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
            return action.help
        return f"{action.help} (default: {action.default})"


#: add_argument_group's return type, which argparse does not export
_Group = argparse._ArgumentGroup


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute bench",
        description=(
            "Replay the same seeded workload against each routing strategy (with --peers,\n"
            "also sglang-router and vllm-router), each on a fresh, cold fleet of simulated\n"
            "vLLM servers behind routers started as users run them, and print one comparison\n"
            "table. Latencies are in simulated time (wall time / --time-scale)."
        ),
        epilog=_EXAMPLES,
        formatter_class=_HelpFormatter,
    )
    run = p.add_argument_group("what to compare")
    _add_fleet_options(run)
    _add_router_options(run)
    _add_target_options(run)
    work = p.add_argument_group("workload (bench/harness/workloads.py)")
    add_workload_options(work)
    _add_seed_options(work)
    _add_arrival_options(work)
    knee.add_knee_options(p.add_argument_group("capacity (bench/harness/knee.py)"))
    _add_output_options(p.add_argument_group("bounds and output"))
    return p


def _add_fleet_options(run: _Group) -> None:
    """The strategies and the simulated fleet they route to."""
    run.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help=f"comma-separated; the first is the baseline. Known: {', '.join(policies.names())}",
    )
    run.add_argument(
        "--backends",
        type=positive(int),
        help=f"simulated vLLM servers (default {DEFAULT_BACKENDS}; with --pd, P + D)",
    )
    run.add_argument(
        "--pd",
        type=_split,
        metavar="P:D",
        help="prefill/decode disaggregation: each strategy also runs on P prefill and D "
        "decode backends (pools with roles, vLLM's kv_transfer_params between them), "
        "beside its row on the same P + D backends combined",
    )
    run.add_argument(
        "--speeds",
        type=_speeds,
        metavar="LIST",
        help="a mixed fleet: each backend's speed in order, e.g. 1,1,0.5,0.5 (the last two "
        "prefill and decode at half speed; kvroute sim --speeds); every row runs on it",
    )
    run.add_argument(
        "--time-scale",
        type=positive(float),
        help="simulated durations x this (0.5 = twice as fast as real hardware); default "
        f"{DEFAULT_TIME_SCALE:g}, or 1 with --target (give a simulated target's own scale) "
        "and with --knee (at 0.5 a small host runs out of CPU below a fleet's capacity)",
    )
    run.add_argument(
        "--sim-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass to the simulator, e.g. --sim-arg=--num-gpu-blocks=12000 (see kvroute sim -h)",
    )
    run.add_argument(
        "--prefix-length", type=positive(int), help="router prefix_length (PREFIX_AWARE)"
    )
    run.add_argument(
        "--concurrency-threshold",
        type=positive(int),
        help="router concurrency_threshold (PREFIX_AWARE)",
    )
    run.add_argument(
        "--sample",
        type=_non_negative,
        help="router sample (KV_AWARE): backends drawn beside the holders; 0 scores all",
    )
    run.add_argument(
        "--param",
        action="append",
        default=[],
        type=_param,
        metavar="KEY=VALUE",
        help="any other routing parameter, VALUE in YAML, for the strategies that have KEY, "
        "e.g. --param 'tiers={}' (KV_AWARE scoring the GPU alone) or "
        "--param prefill_tokens_per_s=8000; repeatable",
    )


def _add_router_options(run: _Group) -> None:
    """How each row's router runs: kvroute's workers, replicas, the peers."""
    run.add_argument(
        "--workers",
        type=_non_negative,
        default=0,
        metavar="N",
        help="kvroute processes per router (config `workers`); 0: one per usable core, as "
        "`kvroute serve` starts by default",
    )
    run.add_argument(
        "--replicas",
        type=positive(int),
        default=1,
        metavar="R",
        help="router processes per row, one config, each on its own port; each request goes "
        "to one of them drawn from the seed. Peers get R replicas too",
    )
    run.add_argument(
        "--cluster",
        nargs="?",
        const="on",
        choices=["on", "both"],
        help="kvroute's replicas share placements and load through a redis-server started "
        "for each row (config `cluster`); its rows are labelled STRATEGY+cluster. `both`: "
        "each strategy without it, then with it, so that one run compares them",
    )
    run.add_argument(
        "--redis-outage",
        type=_outage,
        metavar="AFTER:SECONDS",
        help="with --cluster: stop the row's redis-server AFTER seconds into the replay and "
        "start it again SECONDS later (real time), e.g. 8:10",
    )
    run.add_argument(
        "--set",
        action="append",
        default=[],
        type=_setting,
        dest="settings",
        metavar="PATH=VALUE",
        help="any other setting of kvroute's config file for every kvroute row, PATH "
        "dotted, VALUE in YAML, e.g. --set flow.saturation.enabled=false or --set "
        "telemetry.scrape_interval=2; repeatable. The bench sets the fleet, `listen`, "
        "`workers`, `cluster` and `routing` itself (see --workers, --cluster, --param)",
    )
    run.add_argument(
        "--peers",
        action="store_true",
        help="add rows for sglang-router (cache_aware, round_robin) and vllm-router "
        "(cache_aware) on the same fleet and workload, and on multi-turn (whose requests "
        "name their conversation as a session) their session modes (sglang-router manual, "
        "vllm-router consistent_hash); pip-installed on first use",
    )
    run.add_argument(
        "--peers-venv",
        type=Path,
        default=PEERS_VENV,
        metavar="DIR",
        help="the peers' virtualenv, created on first use (shared with bench.studies.throughput)",
    )
    run.add_argument(
        "--no-install",
        dest="install",
        action="store_false",
        help="never pip: a peer not already in --peers-venv is a row of n/a",
    )


def _add_target_options(run: _Group) -> None:
    """A router or server already running, instead of a fleet started here."""
    run.add_argument(
        "--target",
        metavar="URL",
        help="send the workload to this router or server instead (e.g. http://127.0.0.1:8000); "
        "starts nothing and ignores --strategies, --workers, --replicas and --peers",
    )
    run.add_argument("--model", help="model name to request (default: the target's first model)")


def add_workload_options(work: _Group) -> None:
    """The workload's shape and sizes (bench/harness/workloads.py's WorkloadSpec); `workload_spec`
    reads them back."""
    work.add_argument(
        "--workload",
        choices=sorted(SHAPES),
        default="long-prefix",
        help="long-prefix: shared 8,000-token documents + own questions; short-prefix: the "
        "same with 500 tokens; hot-prefix: documents drawn by a Zipf law; multi-turn: "
        "conversations resent whole each turn, behind a 1,000-token system prompt; "
        "no-sharing: unique prompts",
    )
    work.add_argument("--requests", type=int, default=300, help="requests per strategy")
    work.add_argument("--groups", type=int, default=50, help="prefix groups / conversations")
    work.add_argument(
        "--prefix-tokens", type=int, help="shared prompt length (default: the shape's)"
    )
    work.add_argument("--question-tokens", type=int, default=100, help="per-request question")
    work.add_argument("--max-tokens", type=int, default=100, help="output tokens per request")
    work.add_argument("--zipf-s", type=float, default=1.1, help="hot-prefix Zipf exponent")
    work.add_argument(
        "--system-prompt",
        choices=("shared", "per-conversation"),
        default="shared",
        help="multi-turn: one system prompt for every conversation, or one each",
    )


def _add_seed_options(work: _Group) -> None:
    """One seed, or several for the whole comparison once each."""
    seeds = work.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=0, help="workload, policy and replica seed")
    seeds.add_argument(
        "--seeds",
        type=_seed_list,
        metavar="LIST",
        help="comma-separated, e.g. 0,1,2: the whole comparison once per seed, each seed's "
        "table, then each row's mean over the seeds",
    )


def _add_arrival_options(work: _Group) -> None:
    """Open-loop Poisson arrivals or a closed loop of clients."""
    arrivals = work.add_mutually_exclusive_group()
    arrivals.add_argument(
        "--rate",
        type=positive(float),
        help=f"Poisson arrivals per simulated second (default: {DEFAULT_RATE:g})",
    )
    arrivals.add_argument(
        "--concurrency", type=positive(int), help="closed loop with this many clients"
    )
    work.add_argument("--duration", type=float, help="stop Poisson arrivals after this (sim s)")


def _add_output_options(out: _Group) -> None:
    """Each row's bounds, the hop calibration, where results go."""
    out.add_argument(
        "--max-wall",
        type=positive(float),
        default=600.0,
        help="wall seconds per row and seed (with --knee, per step), then cancel",
    )
    out.add_argument(
        "--calibration",
        type=_non_negative,
        default=40,
        help="direct/routed pairs for the hop cost (0: skip)",
    )
    out.add_argument("--out", type=Path, metavar="DIR", help="write results.json and a PNG")


def positive(kind: type) -> Callable[[str], float]:
    """An argparse type: `kind` of the text, refused unless above 0."""

    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def _param(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), _yaml_value(key, value)


def _yaml_value(name: str, value: str) -> object:
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(f"{name}: not a YAML value: {exc}") from None


#: config sections the bench writes itself, which --set may not
_BENCH_OWNED = frozenset(
    {"backends", "cluster", "discovery", "listen", "pools", "routing", "workers"}
)


def _setting(text: str) -> tuple[tuple[str, ...], object]:
    """PATH=VALUE (--set): the dotted path's keys and the YAML value."""
    path, sep, value = text.partition("=")
    keys = tuple(k.strip() for k in path.split("."))
    if not sep or not all(keys):
        raise argparse.ArgumentTypeError(
            f"expected PATH=VALUE, e.g. flow.enabled=false, got {text!r}"
        )
    if keys[0] in _BENCH_OWNED:
        raise argparse.ArgumentTypeError(
            f"{path}: the bench sets `{keys[0]}` itself (--workers, --cluster, --param)"
        )
    return keys, _yaml_value(path, value)


def _router_settings(args: argparse.Namespace, strategies: Sequence[str]) -> dict[str, object]:
    """The --set settings as config sections (later ones win), checked against the
    config's schema before any process starts."""
    if args.settings and args.target:
        raise ValueError("--set configures the routers the bench starts; not with --target")
    settings: dict[str, object] = {}
    for keys, value in args.settings:
        section = settings
        for key in keys[:-1]:
            inner = section.get(key)
            section[key] = inner = inner if isinstance(inner, dict) else {}
            section = inner
        section[keys[-1]] = value
    _check_config(strategies, {}, settings)
    return settings


def _check_config(
    strategies: Sequence[str], knobs: dict[str, object], settings: dict[str, object] | None
) -> None:
    """A bad value fails here, as a ValueError, before any process starts."""
    for strategy in strategies:
        try:
            router_config(strategy, [{"url": "http://127.0.0.1:1"}], knobs, settings=settings)
        except ConfigError as exc:
            raise ValueError(str(exc).removeprefix("kvroute bench: ")) from None


def _routing_knobs(args: argparse.Namespace, strategies: Sequence[str]) -> dict[str, object]:
    """The routing parameters given, flags and --param alike; a --param key that none of
    `strategies` has is an error, not a silent no-op."""
    knobs = {
        "prefix_length": args.prefix_length,
        "concurrency_threshold": args.concurrency_threshold,
        "sample": args.sample,
    }
    known = {f for s in strategies for f in policies.policy_class(s).params_type.__struct_fields__}
    for key, value in args.param:
        if key not in known:
            raise ValueError(
                f"--param {key}: no routing parameter of {', '.join(strategies)} is named so; "
                f"known: {', '.join(sorted(known))}"
            )
        knobs[key] = value
    given = {k: v for k, v in knobs.items() if v is not None}
    _check_config(strategies, given, None)
    return given


def _split(text: str) -> tuple[int, int]:
    prefill, sep, decode = text.partition(":")
    if not sep or not prefill.isdigit() or not decode.isdigit() or "0" in (prefill, decode):
        raise argparse.ArgumentTypeError(f"expected P:D with P, D >= 1, got {text!r}")
    return int(prefill), int(decode)


def _backend_count(args: argparse.Namespace) -> int:
    """--backends, or P + D with --pd (which must then agree)."""
    if args.pd is None:
        return args.backends or DEFAULT_BACKENDS
    if args.target:
        raise ValueError("--pd starts its own fleet; it does not go with --target")
    total = sum(args.pd)
    if args.backends not in (None, total):
        raise ValueError(
            f"--pd {args.pd[0]}:{args.pd[1]} is {total} backends, not --backends {args.backends}"
        )
    return total


def _speeds(text: str) -> tuple[float, ...]:
    try:
        speeds = tuple(float(part) for part in text.split(","))
    except ValueError:
        speeds = ()
    if not speeds or min(speeds) <= 0:
        raise argparse.ArgumentTypeError(f"want positive numbers like 1,1,0.5,0.5, got {text!r}")
    return speeds


def _fleet_speeds(args: argparse.Namespace, backends: int) -> tuple[float, ...] | None:
    """--speeds, one per backend of the simulated fleet."""
    if args.speeds is None:
        return None
    if args.target:
        raise ValueError("--speeds sets the simulated fleet; it does not go with --target")
    if len(args.speeds) != backends:
        raise ValueError(f"--speeds gives {len(args.speeds)} speeds for {backends} backends")
    return args.speeds


def _outage(text: str) -> tuple[float, float]:
    """--redis-outage's AFTER:SECONDS."""
    try:
        after, seconds = (float(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"AFTER:SECONDS, got {text}") from None
    if after < 0 or seconds <= 0:
        raise argparse.ArgumentTypeError(f"AFTER >= 0 and SECONDS > 0, got {text}")
    return after, seconds


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _seed_list(text: str) -> list[int]:
    seeds = [int(part) for part in text.split(",") if part.strip()]
    if not seeds or len(set(seeds)) < len(seeds):
        raise argparse.ArgumentTypeError(f"want distinct seeds like 0,1,2, got {text!r}")
    return seeds


class Options(NamedTuple):
    """How to run the benchmark, besides the workload."""

    strategies: list[str]
    backends: int
    time_scale: float
    sim_args: list[str]
    routing: dict[str, object]
    target: str | None
    model: str | None
    concurrency: int | None
    max_wall: float
    calibration: int
    seed: int = 0  # the workload's, the policies' and the replica draw's
    workers: int = 0  # per kvroute router; 0: one per usable core, as `kvroute serve`
    replicas: int = 1
    #: kvroute's replicas share through Redis (config `cluster`): "on", "both" or None
    cluster: str | None = None
    #: with cluster: Redis stopped this many seconds into each replay, for so many
    redis_outage: tuple[float, float] | None = None
    peers: tuple[Peer, ...] = ()
    #: (prefill, decode) backends: each strategy also runs disaggregated
    pd: tuple[int, int] | None = None
    speeds: tuple[float, ...] | None = None  # each simulated backend's (a mixed fleet)
    #: kvroute's other config settings (--set), as sections
    settings: dict[str, object] | None = None


class _Split(NamedTuple):
    """A strategy's row on prefill and decode pools (--pd)."""

    strategy: str
    prefill: int
    decode: int

    @property
    def label(self) -> str:
        return f"{self.strategy}-pd{self.prefill}:{self.decode}"

    @property
    def roles(self) -> list[str]:
        """The simulator's --roles, one per backend in fleet order."""
        return ["--roles", *["prefill"] * self.prefill, *["decode"] * self.decode]


class _Seeded(NamedTuple):
    """One seed's workload and the rows measured with it."""

    workload: WorkloadSpec
    requests: int
    runs: list[Run]
    summaries: list[Summary]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        workload, options = _from_args(args)
        ramp = knee.knee_settings(args, sum(options.speeds or [1.0] * options.backends))
    except ValueError as exc:
        parser.error(str(exc))
    seeds = args.seeds or [args.seed]
    try:
        if args.peers and options.target is None:
            sessions = workload.shape == "multi-turn"
            peers = find_peers(args.peers_venv, args.install, sessions)
            options = options._replace(peers=peers)
        if ramp is not None:
            knees = uvloop.run(_until_signal(_knees(workload, options, ramp)))
            return _print_knees(knees, workload, options, ramp, args.out, argv)
        results = uvloop.run(_until_signal(_every_seed(workload, seeds, options)))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("\nkvroute bench: interrupted; everything started was stopped", file=sys.stderr)
        return 130
    except HarnessError as exc:
        print(f"kvroute bench: {exc}", file=sys.stderr)
        return 1
    _print(results, options)
    if args.out is not None:
        _write(args.out, argv, options, results)
    summaries = [s for r in results for s in r.summaries if not s.unmeasured]
    failed = any(s.unmeasured.startswith(FAILED) for r in results for s in r.summaries)
    # 1: a measured row served nothing, or a row failed
    return 0 if all(s.ok for s in summaries) and not failed else 1


async def _every_seed(
    workload: WorkloadSpec, seeds: Sequence[int], options: Options
) -> list[_Seeded]:
    """The whole comparison once per seed, in order."""
    out = []
    for seed in seeds:
        seeded = msgspec.structs.replace(workload, seed=seed)
        specs = generate(seeded)
        runs = await run_bench(specs, options._replace(seed=seed), _progress_factory())
        out.append(_Seeded(seeded, len(specs), runs, [summarize(r) for r in runs]))
    return out


async def _knees(
    workload: WorkloadSpec, options: Options, ramp: knee.KneeSettings
) -> list[knee.KneeRow]:
    """Each row's ramp (bench/harness/knee.py), every step through `run_row`."""
    progress = _progress_factory()
    rows = [knee.Ramped(row_label(r), isinstance(r, Peer), r) for r in bench_rows(options)]

    async def step(row: object, specs: Sequence[RequestSpec], label: str) -> Run:
        assert isinstance(row, str | _Split | Peer)  # one of `rows`, handed back
        on_done = progress(label, len(specs)) if progress else None
        return await run_row(row, specs, options, on_done)

    def told(label: str, done: knee.KneeStep) -> None:
        print(f"kvroute bench --knee: {knee.step_line(label, done)}", file=sys.stderr, flush=True)

    return await knee.find_knees(rows, workload, ramp, step, told)


def _print_knees(
    knees: list[knee.KneeRow],
    workload: WorkloadSpec,
    options: Options,
    ramp: knee.KneeSettings,
    out: Path | None,
    argv: Sequence[str] | None,
) -> int:
    """The knee table, and with --out its results.json and chart; 1 if a measured step
    served nothing."""
    ramped = f"Poisson rates ramped from {ramp.start:.2f} req/s by {ramp.factor:g}x (simulated)"
    print(_header(workload, options, len(generate(workload)), ramped))
    for line in knee.lines(knees, ramp):
        print(line)
    for line in _machine([step for row in knees for step in row.steps], options):
        print(line)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        doc = {
            "command": ["kvroute", "bench", *(sys.argv[1:] if argv is None else argv)],
            "workload": workload,
            "options": options._asdict(),
            "knee": ramp._asdict(),
            "rows": knees,
        }
        (out / "results.json").write_bytes(msgspec.json.encode(doc))
        drawn = knee.chart(knees, ramp, out / "knee.png")
        print(f"wrote {out / 'results.json'}" + (f" and {out / 'knee.png'}" if drawn else ""))
    failed = any(r.unmeasured.startswith(FAILED) for r in knees)
    return 0 if all(s.summary.ok for r in knees for s in r.steps) and not failed else 1


def _from_args(args: argparse.Namespace) -> tuple[WorkloadSpec, Options]:
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in policies.names()]
    if unknown or not strategies:
        raise ValueError(f"unknown strategies {unknown}; known: {', '.join(policies.names())}")
    rate = None if args.concurrency else (args.rate or DEFAULT_RATE)
    workload = workload_spec(args, rate, args.duration)
    backends = _backend_count(args)
    options = Options(
        strategies=["target"] if args.target else strategies,
        backends=backends,
        time_scale=args.time_scale or (1.0 if args.target or args.knee else DEFAULT_TIME_SCALE),
        sim_args=args.sim_arg,
        routing=_routing_knobs(args, strategies),
        settings=_router_settings(args, strategies) or None,
        target=args.target.rstrip("/") if args.target else None,
        model=args.model,
        concurrency=args.concurrency,
        max_wall=args.max_wall,
        calibration=args.calibration,
        workers=args.workers,
        replicas=args.replicas,
        cluster=args.cluster,
        redis_outage=args.redis_outage,
        pd=args.pd,
        speeds=_fleet_speeds(args, backends),
    )
    return workload, options


def workload_spec(
    args: argparse.Namespace, rate: float | None, duration: float | None = None
) -> WorkloadSpec:
    """The WorkloadSpec of `add_workload_options`' flags; ValueError names a bad flag."""
    fields = {
        "shape": args.workload,
        "requests": args.requests,
        "groups": args.groups,
        "prefix_tokens": args.prefix_tokens,
        "question_tokens": args.question_tokens,
        "max_tokens": args.max_tokens,
        "zipf_s": args.zipf_s,
        "system_prompt": args.system_prompt,
        "rate": rate,
        "duration": duration,
    }
    try:
        return msgspec.convert(fields, WorkloadSpec)  # checks the bounds
    except msgspec.ValidationError as exc:  # "... - at `$.prefix_tokens`" -> --prefix-tokens
        flag = re.sub(r"\$\.(\w+)", lambda m: "--" + m[1].replace("_", "-"), str(exc))
        raise ValueError(flag.replace("--shape", "--workload")) from None


async def _until_signal(work: Awaitable[_T]) -> _T:
    """Await `work`; SIGTERM cancels it like Ctrl-C does, so every `finally` still runs."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await work


#: one row of the table: a kvroute strategy, its --pd split, or a peer router
Row = str | _Split | Peer


def bench_rows(options: Options) -> list[Row]:
    """Each strategy (with --pd, then the same disaggregated), then each peer, in order."""
    rows: list[Row] = []
    for strategy in options.strategies:
        if options.cluster != "on" or options.target is not None:
            rows.append(strategy)
        if options.cluster is not None and options.target is None:
            rows.append(strategy + CLUSTERED)
        if options.pd is not None and options.target is None:
            rows.append(_Split(strategy, *options.pd))
    rows.extend(options.peers)
    return rows


def row_label(row: Row) -> str:
    return row if isinstance(row, str) else row.label


async def run_bench(
    specs: Sequence[RequestSpec], options: Options, progress: _ProgressFactory | None = None
) -> list[Run]:
    """One `Run` per row of `bench_rows` (or one for --target), in order."""
    runs = []
    for row in bench_rows(options):
        on_done = progress(row_label(row), len(specs)) if progress else _ignore
        runs.append(await run_row(row, specs, options, on_done))
    return runs


async def run_row(
    row: Row, specs: Sequence[RequestSpec], options: Options, on_done: _OnDone | None = None
) -> Run:
    """`specs` through `row`'s router: on a fresh, cold fleet started for it, or through
    --target."""
    on_done = on_done or _ignore
    if options.target is None:
        return await _simulated_run(row, specs, options, on_done)
    return await _target_run(options.target, specs, options, on_done)


async def _simulated_run(
    row: str | _Split | Peer, specs: Sequence[RequestSpec], options: Options, on_done: _OnDone
) -> Run:
    """`row` on a fresh, cold fleet. A kvroute router that does not start ends the run;
    a peer that cannot run or start is a row of n/a with the reason. A process of the
    fleet that exits meanwhile fails the row: n/a, with which one and why."""
    if isinstance(row, Peer) and row.python is None:
        return _unmeasured(row.label, _peer_setup(row, options), row.version, options)
    split = row if isinstance(row, _Split) else None
    watch = processes.Watch()
    async with contextlib.AsyncExitStack() as stack:
        backends, sim_pid = await _fleet(stack, options, split.roles if split else [], watch)
        urls = [b["url"] for b in backends]
        redis: _RowRedis | None = None  # a kvroute row's with --cluster
        if isinstance(row, Peer):
            label, router = row.label, _peer_router(row, urls, options)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvroute-bench-"))
            label = split.label if split else row
            strategy = split.strategy if split else row.removesuffix(CLUSTERED)
            redis_url = None
            if label.endswith(CLUSTERED):
                redis = _RowRedis(Path(tmp))
                stack.callback(redis.stop)
                redis_url = redis.start()
            router = _kvroute_router(strategy, backends, options, Path(tmp), split, redis_url)
        try:
            name = label if isinstance(row, Peer) else f"the router ({label})"
            started = processes.replicas(
                router.command, router.ready, options.replicas, watch, name
            )
            replicas = await stack.enter_async_context(started)
        except processes.StartFailed as exc:
            if not isinstance(row, Peer):
                raise HarnessError(f"the router did not start: {exc}") from None
            return _unmeasured(label, router.setup, f"did not start: {exc}", options)
        http = await stack.enter_async_context(aiohttp.ClientSession(timeout=_HTTP_TIMEOUT))
        model = await _model(http, urls[0], options.model)
        hop = await _calibrate(http, urls, replicas[0][0], model, options.calibration)
        trees = [pid for _, root in replicas for pid in procstat.tree(root)]
        pids = {"harness": [os.getpid()], "simulator": [sim_pid], "router": trees}
        setup = msgspec.structs.replace(router.setup, processes=len(trees) // len(replicas))
        names = tuple(b["name"] for b in backends)
        entry = _Entry(label, [url for url, _ in replicas], urls, pids, hop, setup, watch, names)
        if redis is not None and options.redis_outage is not None:
            outage = asyncio.create_task(redis.outage(*options.redis_outage))
            stack.callback(outage.cancel)
        try:
            return await _measured_replay(http, entry, model, specs, options, on_done)
        except processes.ProcessExited as exc:
            print(f"kvroute bench: {label} failed: {exc}", file=sys.stderr, flush=True)
            return _unmeasured(label, setup, f"{FAILED}{exc}", options)


async def _fleet(
    stack: contextlib.AsyncExitStack, options: Options, roles: list[str], watch: processes.Watch
) -> tuple[list[dict], int]:
    """The simulated fleet on `stack` (`roles`: the simulator's --roles, if any): its
    backend configs and its process's pid."""
    sim_args = [*options.sim_args, *roles]
    if options.speeds:
        sim_args += ["--speeds", ",".join(f"{s:g}" for s in options.speeds)]
    fleet = processes.simulator(options.backends, options.time_scale, sim_args, watch)
    try:
        return await stack.enter_async_context(fleet)
    except processes.StartFailed as exc:
        raise HarnessError(f"the simulator did not start:\n  {exc}") from None


async def _target_run(
    target: str, specs: Sequence[RequestSpec], options: Options, on_done: _OnDone
) -> Run:
    async with aiohttp.ClientSession(timeout=_HTTP_TIMEOUT) as http:
        model = await _model(http, target, options.model)
        entry = _Entry(None, [target], [], {"harness": [os.getpid()]}, None, None)
        return await _measured_replay(http, entry, model, specs, options, on_done)


def _unmeasured(label: str, setup: Setup, why: str, options: Options) -> Run:
    return Run(
        strategy=label,
        time_scale=options.time_scale,
        wall_seconds=0.0,
        outcomes=[],
        seed=options.seed,
        setup=setup,
        unmeasured=why,
    )


class _Entry(NamedTuple):
    """Where a replay goes and what is known around it."""

    label: str | None  # None: ask the target (kvroute's decision counter)
    routers: list[str]  # the replicas' URLs
    backends: list[str]  # simulated backends to snapshot; empty for a target
    pids: dict[str, list[int]]  # processes whose CPU share is measured, by role
    hop: float | None
    setup: Setup | None
    watch: processes.Watch | None = None  # the fleet's processes; None for a target
    names: tuple[str, ...] = ()  # the simulated backends' names in kvroute's config, as `backends`


async def _measured_replay(
    http: aiohttp.ClientSession,
    entry: _Entry,
    model: str,
    specs: Sequence[RequestSpec],
    options: Options,
    on_done: _OnDone,
) -> Run:
    """Snapshot, replay through `entry`, snapshot; the Run with every delta."""
    before = await _snapshot(http, entry.routers, entry.backends)
    started = time.monotonic()
    with procstat.cpu_meter(entry.pids) as cpu:
        async with _lag_monitor() as lags:
            outcomes = await _watched(
                replay(
                    entry.routers,
                    model,
                    specs,
                    concurrency=options.concurrency,
                    time_scale=options.time_scale,
                    deadline=options.max_wall,
                    seed=options.seed,
                    on_done=on_done,
                ),
                entry.watch,
            )
    wall = time.monotonic() - started
    after = await _snapshot(http, entry.routers, entry.backends)
    speeds = await _learned(http, entry, after, options.time_scale)
    r0, r1 = scrape.merged(before.routers), scrape.merged(after.routers)
    pairs = zip(before.routers, after.routers, strict=True)
    return Run(
        strategy=entry.label or scrape.reported_strategy(r1) or "target",
        time_scale=options.time_scale,
        wall_seconds=wall,
        outcomes=outcomes,
        backends=_backend_deltas(before, after, entry.backends, outcomes),
        decision_seconds_sum=scrape.delta(r0, r1, "kvroute_routing_decision_seconds_sum"),
        decision_buckets=scrape.bucket_deltas(r0, r1, "kvroute_routing_decision_seconds_bucket"),
        hop_seconds=entry.hop,
        loop_lag_p99=percentile(lags, 0.99),
        cpu=cpu,
        seed=options.seed,
        setup=entry.setup,
        replica_requests=[scrape.delta(a, b, "kvroute_requests_total") for a, b in pairs],
        speeds=speeds,
    )


async def _learned(
    http: aiohttp.ClientSession, entry: _Entry, after: _Snapshot, time_scale: float
) -> list[LearnedSpeed]:
    """A kvroute row's learned speeds on its simulated fleet (its first replica's)."""
    if not entry.names or entry.setup is None or entry.setup.params is None:
        return []
    debug = await scrape.json_of(http, entry.routers[0] + "/debug/routing")
    return learned_speeds(debug, [stats for _, stats in after.backends], entry.names, time_scale)


async def _watched(
    replaying: Awaitable[list[Outcome]], watch: processes.Watch | None
) -> list[Outcome]:
    """The replay's outcomes, unless a process in `watch` exits before it ends or by
    then (ProcessExited): the replay is stopped at once, and one whose requests failed
    waits a little for the exit that may have caused them."""
    if watch is None:
        return await replaying
    replay_task = asyncio.ensure_future(replaying)
    exit_task = asyncio.ensure_future(watch.first_exit())
    try:
        await asyncio.wait((replay_task, exit_task), return_when=asyncio.FIRST_COMPLETED)
        cut = replay_task.done() and any(map(_cut_off, replay_task.result()))
        if cut and not exit_task.done():
            await asyncio.wait((exit_task,), timeout=_EXIT_GRACE_S)
    finally:
        for task in (replay_task, exit_task):
            task.cancel()
        await asyncio.gather(replay_task, exit_task, return_exceptions=True)
    why = watch.exited()
    if why is not None:
        raise processes.ProcessExited(why)
    return replay_task.result()


def _connection_errors() -> frozenset[str]:
    """aiohttp's connection errors' names, as an Outcome's error starts with them."""
    found, todo = set(), [aiohttp.ClientConnectionError]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo += cls.__subclasses__()
    return frozenset(found)


_CONNECTION_ERRORS = _connection_errors()


def _cut_off(outcome: Outcome) -> bool:
    """Whether the request failed on its connection (a router gone, say)."""
    return outcome.error is not None and outcome.error.split(":", 1)[0] in _CONNECTION_ERRORS


# --- the rows' routers ----------------------------------------------------------------


class _Router(NamedTuple):
    """How to start each replica of a row's router, and what the table says about it."""

    command: Callable[[int], list[str]]  # given the replica's port
    ready: str  # a path that answers 200 once it routes
    setup: Setup


class _RowRedis:
    """A fresh redis-server for one row's replicas (`--cluster`), which --redis-outage
    stops in the middle of the replay and starts again where it was."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._port = processes.free_port()
        self._server = contextlib.ExitStack()

    def start(self) -> str:
        """Its URL once it answers; HarnessError if there is none to start."""
        try:
            started = processes.redis_server(self._workdir, port=self._port)
            return self._server.enter_context(started)
        except (FileNotFoundError, processes.StartFailed) as exc:
            raise HarnessError(f"--cluster: {exc}") from None

    def stop(self) -> None:
        self._server.close()

    async def outage(self, after: float, seconds: float) -> None:
        """Down `after` seconds into the replay, for `seconds` (real time)."""
        await asyncio.sleep(after)
        self.stop()
        await asyncio.sleep(seconds)
        self.start()


def _kvroute_router(
    strategy: str,
    backends: list[dict],
    options: Options,
    tmp: Path,
    split: _Split | None,
    redis: str | None = None,
) -> _Router:
    """`kvroute serve` with one config file for every replica, which differ by --port;
    with `split`, the backends in a prefill and a decode pool; with `redis`, the
    replicas share through it (config `cluster`)."""
    knobs = {**options.routing, "seed": options.seed}
    prefill = split.prefill if split else None
    config = router_config(
        strategy, backends, knobs, options.workers, prefill, redis, options.settings
    )
    cmd = processes.kvroute_serve(config, tmp / "router.yaml")
    setup = Setup(
        router="kvroute serve",
        policy=strategy,
        params=msgspec.to_builtins(config.routing),
        workers=worker_count(config),
        workers_config=config.workers,
        replicas=options.replicas,
        kv_events=any(b.kv_events for b in config.backends),
        cluster=config.cluster is not None,
        redis_outage=options.redis_outage if config.cluster is not None else None,
        pools=f"prefill {split.prefill} + decode {split.decode}" if split else None,
        settings=options.settings,
    )
    return _Router(lambda port: [*cmd, "--port", str(port)], "/ready", setup)


def _peer_router(peer: Peer, backends: list[str], options: Options) -> _Router:
    assert peer.python is not None
    python = Path(peer.python)
    return _Router(
        lambda port: peer_cmd(python, peer.package, backends, port, peer.policy),
        "/readiness",  # 200 once its workers passed their health checks
        _peer_setup(peer, options),
    )


def _peer_setup(peer: Peer, options: Options) -> Setup:
    version = peer.version if peer.python else None
    return Setup(
        router=peer.package, policy=peer.policy, version=version, replicas=options.replicas
    )


def router_config(
    strategy: str,
    backends: list[dict],
    knobs: dict[str, object],
    workers: int = 0,
    prefill: int | None = None,
    redis: str | None = None,
    settings: dict[str, object] | None = None,
) -> Config:
    """A router on a free port of 127.0.0.1 with `strategy` and the knobs it has;
    `workers` 0 is one per usable core, as `kvroute serve` runs by default. `prefill`:
    the first that many backends are a prefill pool and the rest a decode pool. `redis`:
    the URL its replicas share through (config `cluster`). `settings`: other config
    sections (--set), under the bench's own keys."""
    fields = policies.policy_class(strategy).params_type.__struct_fields__
    routing = {"strategy": strategy, **{k: v for k, v in knobs.items() if k in fields}}
    fleet: dict[str, object] = {"backends": backends}
    if prefill is not None:
        fleet = {
            "pools": [
                {"name": role, "priority": i, "role": role, "backends": part}
                for i, (role, part) in enumerate(
                    (("prefill", backends[:prefill]), ("decode", backends[prefill:]))
                )
            ]
        }
    return build(
        {
            "log_level": "warning",
            **(settings or {}),
            "listen": {"host": "127.0.0.1", "port": 0},
            **fleet,
            "routing": routing,
            "workers": workers,
            **({"cluster": {"redis": {"url": redis}}} if redis else {}),
        },
        "kvroute bench",
    )


# --- measurements ---------------------------------------------------------------------


async def _model(http: aiohttp.ClientSession, url: str, given: str | None) -> str:
    """`given`, or the first model `url` lists. `url` must answer either way, so that an
    unreachable one is one line naming it, not a table of failed requests."""
    try:
        async with http.get(url + "/v1/models") as resp:
            data = (await resp.json()).get("data") or []
    except (aiohttp.ClientConnectionError, TimeoutError) as exc:
        raise HarnessError(f"cannot reach {url}: {_unreachable(exc)}") from None
    except (aiohttp.ClientError, ValueError) as exc:
        if given:
            return given
        raise HarnessError(f"{url}/v1/models did not answer: {exc}; pass --model") from None
    if given:
        return given
    if not data:
        raise HarnessError(f"{url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


def _unreachable(exc: Exception) -> str:
    """Why a connection failed, in the system's words: aiohttp's own message names
    `ssl:default` even for an http URL."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {_HTTP_TIMEOUT.total:g} s"
    if isinstance(exc, OSError) and exc.errno is not None and exc.errno > 0:
        return os.strerror(exc.errno)
    cause = getattr(exc, "os_error", None)  # a failed name lookup, for one
    return str(cause.strerror or cause) if isinstance(cause, OSError) else str(exc)


async def _calibrate(
    http: aiohttp.ClientSession, backends: list[str], router: str, model: str, pairs: int
) -> float | None:
    """Median of (routed - direct) over back-to-back `POST /tokenize` pairs; None for 0 pairs
    or a router that does not proxy /tokenize (sglang-router answers 404).

    Pairing adjacent calls cancels the machine's slow drifts (other processes' load).
    """
    if pairs == 0:
        return None
    body = orjson.dumps({"model": model, "prompt": "calibration"})

    async def timed(url: str) -> float | None:
        t0 = time.perf_counter()
        async with http.post(url + "/tokenize", data=body) as resp:
            await resp.read()
        return time.perf_counter() - t0 if resp.status == 200 else None

    differences = []
    for i in range(pairs + _WARMUP_PAIRS):
        direct = await timed(backends[i % len(backends)])
        routed = await timed(router)
        if direct is None or routed is None:
            return None
        if i >= _WARMUP_PAIRS:
            differences.append(routed - direct)
    return percentile(differences, 0.5)


class _Snapshot(NamedTuple):
    routers: list[scrape.Samples]  # each replica's /metrics
    backends: list[tuple[scrape.Samples, dict]]  # /metrics and /sim/stats of each backend


async def _snapshot(
    http: aiohttp.ClientSession, routers: list[str], backends: list[str]
) -> _Snapshot:
    async def backend(url: str) -> tuple[scrape.Samples, dict]:
        return await scrape.metrics(http, url), await scrape.json_of(http, url + "/sim/stats")

    pages = await asyncio.gather(*(scrape.metrics(http, url) for url in routers))
    return _Snapshot(list(pages), list(await asyncio.gather(*map(backend, backends))))


def _backend_deltas(
    before: _Snapshot, after: _Snapshot, urls: list[str], outcomes: list[Outcome]
) -> list[BackendDelta]:
    """Simulated fleet: each backend's counters. Target: what the target itself exposes."""
    if not urls:
        return _target_deltas(scrape.merged(before.routers), scrape.merged(after.routers), outcomes)
    out = []
    for url, (m0, s0), (m1, s1) in zip(urls, before.backends, after.backends, strict=True):
        out.append(
            BackendDelta(
                name=url,
                requests=scrape.stat_delta(s0, s1, "requests_received"),
                busy_seconds=scrape.stat_delta(s0, s1, "busy_seconds"),
                prefix_hits=scrape.delta(m0, m1, "vllm:prefix_cache_hits_total"),
                prefix_queries=scrape.delta(m0, m1, "vllm:prefix_cache_queries_total"),
                tier_hits=scrape.delta(m0, m1, "vllm:external_prefix_cache_hits_total"),
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


def _print(results: Sequence[_Seeded], options: Options) -> None:
    """Each seed's table, then the rows' configuration, their means over the seeds, the
    footer."""
    for i, seeded in enumerate(results):
        print(("\n" if i else "") + _header(seeded.workload, options, seeded.requests))
        print(table(seeded.summaries))
        if not i:
            print(textwrap.fill(legend(seeded.summaries, _clock(options)), 92))
        for line in reading(seeded.summaries):
            print(line)
    described = [
        f"  {run.strategy}: {_described(run.setup, run.replica_requests, run.seed)}"
        for run in results[0].runs
        if run.setup  # none for a --target run
    ]
    if described:
        print(
            "\nConfiguration of each row (every seed alike, the policies seeded with the table's):"
        )
        print("\n".join(described))
    if len(results) > 1:
        seeds = ", ".join(str(r.workload.seed) for r in results)
        print(f"\nMean over seeds {seeds} (n/a if a seed has none):")
        print(means_table(seed_means([s for r in results for s in r.summaries])))
    for line in _footer([run for r in results for run in r.runs], options):
        print(line)


def _described(setup: Setup, replica_requests: Sequence[float | None], seed: int | None) -> str:
    """A row's configuration in words: router, processes, replicas, KV events, params."""
    replicas = counted(setup.replicas, "replica")
    if len(replica_requests) > 1 and any(n is not None for n in replica_requests):
        counts = " / ".join("n/a" if n is None else f"{n:.0f}" for n in replica_requests)
        replicas += f" (requests {counts} with seed {seed})"
    if setup.params is None:
        version = f" {setup.version}" if setup.version else ""
        return f"{setup.router}{version} --policy {setup.policy} with its defaults, {replicas}"
    workers = counted(setup.workers, "worker")
    if setup.workers_config == 0:
        workers += " (one per usable core)"
    if setup.processes is not None:
        workers += f", {setup.processes} processes"
    skip = {"strategy", "seed"}
    knobs = [f"{k}={_compact(v)}" for k, v in setup.params.items() if k not in skip]
    events = "on" if setup.kv_events else "off"
    if setup.cluster:
        replicas += " sharing through Redis"
    if setup.redis_outage is not None:
        after, seconds = setup.redis_outage
        replicas += f" (down {after:g}-{after + seconds:g} s into the replay, real time)"
    head = f"kvroute serve, {workers} per replica, {replicas}, KV events {events}"
    if setup.pools:
        head += f", pools {setup.pools}"
    if setup.settings:
        head += ", config " + " ".join(_dotted(setup.settings))
    return "; ".join([head, " ".join(knobs)] if knobs else [head])


def _dotted(settings: dict[str, object], prefix: str = "") -> list[str]:
    """`settings` as the PATH=VALUE words --set took."""
    words = []
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            words += _dotted(value, f"{prefix}{key}.")
        else:
            words.append(f"{prefix}{key}={_compact(value)}")
    return words


def _compact(value: object) -> str:
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def _header(workload: WorkloadSpec, options: Options, n: int, arrivals: str = "") -> str:
    w = workload
    if w.shape == "no-sharing":
        prompts = f"unique {w.shared_tokens + w.question_tokens}-token prompts"
    elif w.shape == "multi-turn":
        prompts = (
            f"{counted(w.groups, 'conversation')}, {w.shared_tokens}-token system prompt "
            f"({'one for all' if w.system_prompt == 'shared' else 'one each'}), "
            f"{w.question_tokens}-token questions"
        )
    else:
        prompts = (
            f"{counted(w.groups, 'group')}, {w.shared_tokens}-token shared prompts, "
            f"{w.question_tokens}-token questions"
        )
    if options.concurrency:
        arrivals = f"closed loop, {counted(options.concurrency, 'client')}"
    elif not arrivals:  # a --knee ramp names its own
        arrivals = f"Poisson {w.rate:g} req/s" + (" (simulated)" if _simulated(options) else "")
    if options.target:
        where = f"target {options.target}"
    else:
        where = f"{options.backends} simulated backends, time_scale {options.time_scale:g}"
        if options.speeds:
            where += f", speeds {','.join(f'{s:g}' for s in options.speeds)}"
        if options.pd:
            where += f" (P/D rows: {options.pd[0]} prefill + {options.pd[1]} decode)"
    return (
        f"{w.shape}: {counted(n, 'request')}, {prompts}, {counted(w.max_tokens, 'output token')}, "
        f"{arrivals}, seed {w.seed}; {where}"
    )


def _simulated(options: Options) -> bool:
    """Whether times are simulated: on a fleet started here, or on a target whose scale
    --time-scale gives (a target is measured in wall time by default)."""
    return options.target is None or options.time_scale != 1


def _clock(options: Options) -> str:
    """What the latencies and req/s are in."""
    return "simulated time (wall / time_scale)" if _simulated(options) else "wall time"


def _footer(runs: Sequence[Run], options: Options) -> list[str]:
    clock = _clock(options)
    head = (
        f"Latencies (ms) and req/s are in {clock}. The router's own cost is real time: "
        "decide µs = routing decision (P50), hop ms = added proxy latency (median of "
        "direct/routed pairs)."
    )
    lines = [head, *_machine(runs, options)]
    if options.speeds:
        lines += speed_lines([(r.strategy, r.seed, r.speeds) for r in runs])
    return lines


def _machine(runs: Sequence[Run | knee.KneeStep], options: Options) -> list[str]:
    """The processes' CPU shares and this loop's lag over the replays, and what they
    distort."""
    names = sorted({name for r in runs for name in r.cpu})
    shares = ", ".join(f"{n} {max(r.cpu.get(n, 0.0) for r in runs):.0%}" for n in names)
    lag = max((r.loop_lag_p99 or 0.0 for r in runs), default=0.0)
    lines = [
        f"CPU, peak share of one core over a replay (router: every process of every "
        f"replica): {shares or 'n/a'}; this process's event loop lag p99 {lag * 1e3:.1f} ms.",
    ]
    if options.cluster is not None:
        lines.append(f"Router CPU per request (real ms, every replica's processes): {_cpu(runs)}.")
    if options.target is None and options.time_scale < 1:
        lines.append(
            f"A router's own added latency is real time, so it weighs {1 / options.time_scale:g}x "
            "in the latency columns: compare routers' overheads at --time-scale 1."
        )
    busiest = max((sum(r.cpu.values()) for r in runs), default=0.0)
    cores = usable_cores()
    if options.target is None and busiest >= _HOST_BUSY * cores:
        lines.append(
            f"WARNING: the busiest replay's processes took {busiest:.0%} of a core, of the "
            f"{cores} this host has: its latencies are the host's as much as the routers'; "
            "use a larger --time-scale."
        )
    if lag / options.time_scale > _LAG_WARNING:
        lines.append(
            f"WARNING: that lag is {lag / options.time_scale * 1e3:.0f} ms of simulated time: "
            "the machine is short of CPU and small latencies are inflated; use a larger "
            "--time-scale."
        )
    return lines


def _cpu(runs: Sequence[Run]) -> str:
    """Each row's router CPU per request, averaged over its seeds: what sharing through
    Redis (--cluster) costs beside the row without it."""
    per: dict[str, list[float]] = {}
    for r in runs:
        if r.outcomes and "router" in r.cpu:
            per.setdefault(r.strategy, []).append(
                r.cpu["router"] * r.wall_seconds / len(r.outcomes)
            )
    return ", ".join(f"{row} {sum(v) / len(v) * 1e3:.2f}" for row, v in per.items()) or "n/a"


def _write(
    out: Path, argv: Sequence[str] | None, options: Options, results: Sequence[_Seeded]
) -> None:
    """results.json (every seed's summaries and runs, each tagged with its seed; with
    several seeds the means too) and a PNG per seed."""
    out.mkdir(parents=True, exist_ok=True)
    summaries = [s for r in results for s in r.summaries]
    doc = {
        "command": ["kvroute", "bench", *(sys.argv[1:] if argv is None else argv)],
        "workload": results[0].workload,
        "seeds": [r.workload.seed for r in results],
        "options": options._asdict(),
        "summaries": summaries,
        "runs": [run for r in results for run in r.runs],
        "means": seed_means(summaries) if len(results) > 1 else [],
    }
    (out / "results.json").write_bytes(msgspec.json.encode(doc))
    pngs = []
    for r in results:
        name = (
            "ttft_hit_rate.png" if len(results) == 1 else f"ttft_hit_rate_seed{r.workload.seed}.png"
        )
        if chart(r.runs, r.summaries, out / name):
            pngs.append(str(out / name))
    if pngs:
        print(f"wrote {out / 'results.json'} and {', '.join(pngs)}")
    else:
        print(
            f"wrote {out / 'results.json'}; matplotlib is not installed, so no PNG "
            "(pip install -e '.[bench]')"
        )


if __name__ == "__main__":
    sys.exit(main())
