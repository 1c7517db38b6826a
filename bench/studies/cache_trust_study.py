"""How far KV_AWARE's index can be trusted on backends with small caches, beside other
routers on the same servers: a study, not CI.

For each router of `--routers` (kvroute's strategies, started as `kvroute serve` with no KV
events, and the peers' `package:policy`, e.g. `sglang-router:cache_aware`), on a fresh
fleet (cold caches): the given servers (`--url`, repeatable; not restarted between rows),
llama.cpp servers it starts (`--llama N`, as ../shared/engines/llama-cpp/README.md
installs them) or `kvroute sim` instances with a small cache (`--sim-blocks`). It replays
one `kvroute bench --target` workload through the router and prints the bench's table,
and for kvroute, from the router's /metrics, the kv_hit decisions and the share of them
whose backend found less than half the predicted cached tokens
(`kvroute_kv_hit_shortfalls_total`), and each backend's learned capacity; then one table
of every row.

    python -m bench.studies.cache_trust_study --sim 3 --sim-blocks 200 --no-telemetry -- \\
        --workload long-prefix --groups 6 --prefix-tokens 1400 --requests 150 --rate 1 \\
        --max-tokens 20 --seed 1
    python -m bench.studies.cache_trust_study --llama 3 --llama-server "$LLAMA" \\
        --llama-model /tmp/gemma-3-270m-q4_k_m.gguf --time-scale 1 \\
        --routers KV_AWARE,PREFIX_AWARE,sglang-router:cache_aware,vllm-router:cache_aware -- \\
        --workload long-prefix --groups 6 --prefix-tokens 1400 --requests 34 --rate 0.15 \\
        --max-tokens 8 --seed 1

`--no-telemetry` keeps kvroute from scraping the servers' /metrics, as with an engine
that publishes no vLLM metrics (llama.cpp): its cache size is then unknown to the router.
The peers come from the bench's peers virtualenv (installed on first use, as `kvroute
bench --peers` does). Arguments after `--` go to `kvroute bench --target`.

Reproduces docs/performance.md, "KV_AWARE learning what small caches keep".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import msgspec

from bench.harness import scrape
from bench.harness.peers import PEERS_VENV, find_peers, peer_cmd
from bench.harness.processes import free_port, kvroute_serve, logged, simulator
from bench.harness.report import Summary


class Row(msgspec.Struct, kw_only=True):
    """One router's outcome: the bench's summary, and kvroute's own counts."""

    router: str
    summary: Summary | None
    kv_hits: float | None = None
    short: float | None = None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return asyncio.run(_main(args))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.studies.cache_trust_study",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    p.add_argument("--url", action="append", help="a server to route to (repeatable)")
    p.add_argument("--sim", type=int, default=0, help="simulated servers to start instead")
    p.add_argument("--sim-blocks", type=int, default=1700, help="each one's KV blocks")
    p.add_argument("--time-scale", type=float, default=0.5, help="the simulator's and the bench's")
    p.add_argument("--no-telemetry", action="store_true", help="kvroute scrapes no /metrics")
    p.add_argument(
        "--tokenizer", help="kvroute's routing.tokenizer.kind (default: as `kvroute serve` sets it)"
    )
    p.add_argument(
        "--routers",
        default="KV_AWARE",
        help="comma-separated: kvroute strategies and peers' package:policy (default KV_AWARE)",
    )
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a routing parameter of kvroute's rows, e.g. eviction_penalty=0 (repeatable)",
    )
    p.add_argument("--llama", type=int, default=0, help="llama-server processes to start")
    p.add_argument("--llama-server", help="the llama-server binary")
    p.add_argument("--llama-model", help="the GGUF file it serves")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then kvroute bench's arguments")
    return p


async def _main(args: argparse.Namespace) -> int:
    rows, code = [], 0
    for router in args.routers.split(","):
        async with _fleet(args) as backends:
            row, exit_code = await _study(args, backends, router.strip())
        rows.append(row)
        code = code or exit_code
    _table(rows)
    return code


@contextlib.asynccontextmanager
async def _fleet(args: argparse.Namespace) -> AsyncIterator[list[dict]]:
    """The servers one row routes to, started anew (cold) unless given by `--url`."""
    if args.llama:
        with _llama_servers(args) as urls:
            await asyncio.gather(*(_healthy(u) for u in urls))
            yield [{"url": u, "name": f"llama{i}"} for i, u in enumerate(urls)]
    elif not args.sim:
        yield [{"url": u, "name": f"b{i}"} for i, u in enumerate(args.url or ())]
    else:
        fits = min(32768, (args.sim_blocks - 1) * 16)  # its prompt limit fits in its cache
        blocks = [f"--num-gpu-blocks={args.sim_blocks}", f"--max-model-len={fits}"]
        async with simulator(args.sim, args.time_scale, blocks) as (backends, _):
            yield backends


async def _study(args: argparse.Namespace, backends: list[dict], router: str) -> tuple[Row, int]:
    """`router` in front of `backends`, the workload replayed through it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if ":" in router:
            cmd, ready = _peer(router, [b["url"] for b in backends], port), "/readiness"
        else:
            cmd, ready = kvroute_serve(_config(args, backends, router, port), work / "r.yaml"), ""
        if cmd is None:
            return Row(router=router, summary=None), 0
        with logged(cmd, work / "router.log"):
            async with aiohttp.ClientSession() as http:
                await _ready(http, url, path=ready or "/ready")
                bench = [sys.executable, "-m", "router", "bench", "--target", url]
                bench += ["--time-scale", str(args.time_scale), "--calibration", "0"]
                bench += ["--out", str(work / "out"), *(a for a in args.bench if a != "--")]
                if "--model" not in bench:  # a peer may not list the servers' models
                    bench += ["--model", await _model(http, backends[0]["url"])]
                print(f"\n## {router}", flush=True)
                code = await (await asyncio.create_subprocess_exec(*bench)).wait()
                samples = await scrape.metrics(http, url) if not ready else {}
                debug = await scrape.json_of(http, url + "/debug/routing") if not ready else {}
        found = work / "out" / "results.json"
        summaries = json.loads(found.read_bytes())["summaries"] if found.exists() else []
    summary = msgspec.convert(summaries[0], Summary) if summaries else None
    row = Row(router=router, summary=summary)
    if not ready:
        row.kv_hits, row.short = _report(samples, debug)
    return row, code


def _config(args: argparse.Namespace, backends: list[dict], strategy: str, port: int) -> dict:
    routing: dict[str, object] = {"strategy": strategy}
    if strategy == "KV_AWARE" and args.tokenizer:
        routing["tokenizer"] = {"kind": args.tokenizer}
    for param in args.param:
        key, _, value = param.partition("=")
        routing[key] = json.loads(value)
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "backends": backends,
        "routing": routing,
        "telemetry": {"enabled": not args.no_telemetry},
    }


def _peer(router: str, urls: list[str], port: int) -> list[str] | None:
    """The peer `package:policy` on `port`; None (said) if it cannot run here."""
    package, policy = router.split(":", 1)
    found = {(p.package, p.policy): p for p in find_peers(PEERS_VENV, install=True)}
    peer = found.get((package, policy))
    python = None if peer is None else peer.python
    if python is None:
        why = "not a peer row of kvroute bench" if peer is None else peer.version
        print(f"{router}: not measured: {why}", file=sys.stderr)
        return None
    return peer_cmd(Path(python), package, urls, port, policy)


@contextlib.contextmanager
def _llama_servers(args: argparse.Namespace) -> Iterator[list[str]]:
    """`--llama` llama.cpp servers as ../shared/engines/llama-cpp/README.md runs them: two
    slots each, no RAM prompt cache (each keeps about two prompts), one thread."""
    ports = [free_port() for _ in range(args.llama)]
    flags = ["-t", "1", "-tb", "1", "-c", "8192", "-np", "2", "--metrics", "--no-warmup"]
    flags += ["--swa-full", "--no-jinja", "--chat-template", "gemma", "--cache-ram", "0"]
    serve = [args.llama_server, "-m", args.llama_model, "--host", "127.0.0.1"]
    procs = [
        subprocess.Popen(
            [*serve, "--port", str(p), *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    try:
        yield [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


async def _healthy(url: str) -> None:
    async with aiohttp.ClientSession() as http:
        await _ready(http, url, path="/health")


async def _ready(
    http: aiohttp.ClientSession, url: str, seconds: float = 40.0, path: str = "/ready"
) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            async with http.get(url + path) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the router at {url} was not ready within {seconds:.0f}s")


def _report(samples: scrape.Samples, debug: dict) -> tuple[float, float]:
    """Print and return the kv_hit decisions and those whose backend found less than
    half the predicted tokens; print each backend's learned capacity."""
    hits = sum(
        v
        for (name, labels), v in samples.items()
        if name == "kvroute_policy_decisions_total" and ("reason", "kv_hit") in labels
    )
    short = scrape.total(samples, "kvroute_kv_hit_shortfalls_total") or 0.0
    print(f"kv_hit decisions: {hits:.0f}; finding less than half the predicted tokens: {short:.0f}")
    for name, state in debug.get("backends", {}).items():
        speed = state.get("speed")
        speed = f"{speed} ({state.get('speed_source')})" if speed else "the configured prior"
        print(
            f"  {name}: learned {state.get('learned_cache')}, index keys {state['index_keys']}, "
            f"speed {speed}"
        )
    return hits, short


def _table(rows: list[Row]) -> None:
    """Every router's row: TTFT and E2E in ms (of the bench's clock), hit rate, the
    busiest backend's requests over the mean, and kvroute's kv_hit decisions that fell
    short."""
    print(
        "\n| router | ok | failed | TTFT p50 | p90 | p99 | E2E p50 | p99 | KV hit | spread req "
        "| kv_hit decisions | found < half |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        s = row.summary
        if s is None:
            print(f"| {row.router} | not measured |" + " |" * 10)
            continue
        short = "n/a"
        if row.kv_hits:
            short = f"{row.short:.0f} ({100 * (row.short or 0) / row.kv_hits:.1f}%)"
        cells = [s.ok, s.failed, _ms(s.ttft_p50), _ms(s.ttft_p90), _ms(s.ttft_p99)]
        cells += [_ms(s.e2e_p50), _ms(s.e2e_p99)]
        hit = "n/a" if s.hit_rate is None else f"{100 * s.hit_rate:.1f}%"
        spread = "n/a" if s.spread_requests is None else f"{s.spread_requests:.2f}"
        decisions = "n/a" if row.kv_hits is None else f"{row.kv_hits:.0f}"
        print(
            f"| {row.router} | " + " | ".join(map(str, cells)) + f" | {hit} | {spread} "
            f"| {decisions} | {short} |"
        )


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.0f}"


async def _model(http: aiohttp.ClientSession, url: str) -> str:
    """The first model `url` serves (a llama.cpp server answers to its GGUF's path)."""
    async with http.get(url + "/v1/models") as resp:
        return (await resp.json(content_type=None))["data"][0]["id"]


if __name__ == "__main__":
    sys.exit(main())
