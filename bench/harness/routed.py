"""One replay through kvroute over a simulated fleet: the simulator in a child process,
kvroute as `kvroute serve` starts it (one worker per usable core) with a config built
for the fleet's backends, the workload sent to it, the router's /metrics read before
and after. What bench.studies.pools runs on."""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import aiohttp
import msgspec
import uvloop

from bench.harness import processes, scrape
from bench.harness.loadgen import Outcome, replay
from bench.harness.workloads import RequestSpec

MODEL = "sim-llama-70b"


class Routed(msgspec.Struct, kw_only=True):
    backends: list[dict]  # the simulated fleet's backend configs, in order
    outcomes: list[Outcome]
    before: scrape.Samples  # the router's /metrics
    after: scrape.Samples


async def replay_routed(
    backends: int,
    sim_args: Sequence[str],
    config: Callable[[list[dict]], dict],
    specs: Sequence[RequestSpec],
    *,
    time_scale: float,
    max_wall: float,
    seed: int,
    during: Callable[[aiohttp.ClientSession, str], AbstractAsyncContextManager] | None = None,
) -> Routed:
    """Replay `specs` (open loop) through kvroute configured by `config(backends)`;
    inside `during(session, url)`, when given (work of its own beside the replay)."""
    async with contextlib.AsyncExitStack() as stack:
        sim = processes.simulator(backends, time_scale, sim_args)
        fleet, _ = await stack.enter_async_context(sim)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvroute-bench-")))
        cmd = processes.kvroute_serve(config(fleet), tmp / "router.yaml")
        started = processes.replicas(lambda port: [*cmd, "--port", str(port)], "/ready", 1)
        ((url, _),) = await stack.enter_async_context(started)
        http = await stack.enter_async_context(aiohttp.ClientSession())
        before = await scrape.metrics(http, url)
        async with during(http, url) if during else contextlib.nullcontext():
            outcomes = await replay(
                [url], MODEL, specs, concurrency=None, time_scale=time_scale,
                deadline=max_wall, seed=seed,
            )  # fmt: skip
        after = await scrape.metrics(http, url)
    return Routed(backends=fleet, outcomes=outcomes, before=before, after=after)


def run_main(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], Awaitable[int]],
    argv: Sequence[str] | None,
) -> int:
    """A benchmark's command line: its exit status; 2 for a setting it refuses (before
    anything started), said on stderr."""
    args = parser.parse_args(argv)
    try:
        return uvloop.run(run(args))
    except ValueError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
