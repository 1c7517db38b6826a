"""How far KV_AWARE's index can be trusted on backends with small caches: a study, not CI.

Starts `kvroute serve` (KV_AWARE, no KV events) in front of the given servers (`--url`,
repeatable), of llama.cpp servers it starts (`--llama N`, as
../shared/engines/llama-cpp/README.md installs them) or of `kvroute sim` instances with a
small cache (`--sim-blocks`), replays a `kvroute bench --target` workload through it, and prints the
bench's table with, from the router's /metrics, the kv_hit decisions and the share of
them whose backend found less than half the predicted cached tokens
(`kvroute_kv_hit_shortfalls_total`), and each backend's learned capacity.

    python -m bench.studies.cache_trust_study --sim 3 --sim-blocks 200 --no-telemetry -- \\
        --workload long-prefix --groups 6 --prefix-tokens 1400 --requests 150 --rate 1 \\
        --max-tokens 20 --seed 1
    python -m bench.studies.cache_trust_study --llama 3 --llama-server "$LLAMA" \\
        --llama-model /tmp/gemma-3-270m-q4_k_m.gguf --time-scale 1 -- --workload long-prefix \\
        --groups 6 --prefix-tokens 1400 --requests 34 --rate 0.25 --max-tokens 8 --seed 1

`--no-telemetry` keeps the router from scraping the servers' /metrics, as with an engine
that publishes no vLLM metrics (llama.cpp): its cache size is then unknown to the router.
Arguments after `--` go to `kvroute bench --target`.

Reproduces docs/performance.md, "KV_AWARE learning what small caches keep".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from bench.harness import scrape
from bench.harness.processes import free_port, kvroute_serve, logged, simulator


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return asyncio.run(_main(args))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", action="append", help="a server to route to (repeatable)")
    p.add_argument("--sim", type=int, default=0, help="simulated servers to start instead")
    p.add_argument("--sim-blocks", type=int, default=1700, help="each one's KV blocks")
    p.add_argument("--time-scale", type=float, default=0.5, help="the simulator's and the bench's")
    p.add_argument("--no-telemetry", action="store_true", help="the router scrapes no /metrics")
    p.add_argument("--tokenizer", default="chatml4", help="routing.tokenizer.kind")
    p.add_argument("--llama", type=int, default=0, help="llama-server processes to start")
    p.add_argument("--llama-server", help="the llama-server binary")
    p.add_argument("--llama-model", help="the GGUF file it serves")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then kvroute bench's arguments")
    return p


async def _main(args: argparse.Namespace) -> int:
    if args.llama:
        with _llama_servers(args) as urls:
            await asyncio.gather(*(_healthy(u) for u in urls))
            return await _study(args, [{"url": u, "name": f"llama{i}"} for i, u in enumerate(urls)])
    if not args.sim:
        urls = [{"url": u, "name": f"b{i}"} for i, u in enumerate(args.url or ())]
        return await _study(args, urls)
    fits = min(32768, (args.sim_blocks - 1) * 16)  # its prompt limit fits in its cache
    blocks = [f"--num-gpu-blocks={args.sim_blocks}", f"--max-model-len={fits}"]
    async with simulator(args.sim, args.time_scale, blocks) as (backends, _):
        return await _study(args, backends)


async def _study(args: argparse.Namespace, backends: list[dict]) -> int:
    port = free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "backends": backends,
        "routing": {"strategy": "KV_AWARE", "tokenizer": {"kind": args.tokenizer}},
        "telemetry": {"enabled": not args.no_telemetry},
    }
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with logged(kvroute_serve(config, work / "router.yaml"), work / "router.log"):
            async with aiohttp.ClientSession() as http:
                await _ready(http, url)
                bench = [sys.executable, "-m", "router", "bench", "--target", url]
                bench += ["--time-scale", str(args.time_scale), "--calibration", "0"]
                bench += [a for a in args.bench if a != "--"]
                code = await (await asyncio.create_subprocess_exec(*bench)).wait()
                samples = await scrape.metrics(http, url)
                debug = await scrape.json_of(http, url + "/debug/routing")
    _report(samples, debug)
    return code


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


def _report(samples: scrape.Samples, debug: dict) -> None:
    hits = sum(
        v
        for (name, labels), v in samples.items()
        if name == "kvroute_policy_decisions_total" and ("reason", "kv_hit") in labels
    )
    short = scrape.total(samples, "kvroute_kv_hit_shortfalls_total") or 0.0
    share = f"{100 * short / hits:.1f}%" if hits else "n/a"
    print(
        f"kv_hit decisions: {hits:.0f}; finding less than half the predicted tokens: "
        f"{short:.0f} ({share})"
    )
    for name, state in debug.get("backends", {}).items():
        print(f"  {name}: learned {state.get('learned_cache')}, index keys {state['index_keys']}")


if __name__ == "__main__":
    sys.exit(main())
