"""Latency of the gRPC ingress against the HTTP ingress of the same router, in the same run.

An instant backend (`bench.studies.instant_backend`) and one router with both ingresses run as
separate processes; one client alternates batches of direct HTTP, routed HTTP and routed
gRPC calls (the same chat request; unary, then a 16-event stream read to its end), so all
three see the same machine noise. The figures that matter are the differences:
`http - direct` is the HTTP ingress's overhead (as in bench/studies/overhead.py), `grpc - http`
what gRPC adds or saves on top, client library included (grpcio's client on one
HTTP/2 channel, aiohttp's on a pool of HTTP/1.1 connections).

    python -m bench.studies.grpc_overhead --requests 2000 --concurrency 32

No section of docs/performance.md quotes it yet: a study of the gRPC ingress, beside
bench.studies.overhead's HTTP figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator

import aiohttp
import grpc
import orjson

from bench.harness.processes import JSON_HEADERS, PING_BODY, free_port, process, wait_ready
from bench.studies.overhead import parser_for, percentile, write_json
from proto.kvroute.v1 import kvroute_pb2 as pb
from proto.kvroute.v1 import kvroute_pb2_grpc as pb_grpc

_REQUEST = pb.ChatCompletionRequest(
    model="instant",
    messages=[pb.ChatMessage(role="user", content="ping " * 50)],
    sampling=pb.SamplingParams(max_tokens=1),
)
_STREAM_BODY = orjson.dumps({**orjson.loads(PING_BODY), "stream": True})
PATHS = ("direct", "http", "grpc")


@contextlib.contextmanager
def backend_and_router(strategy: str) -> Iterator[tuple[str, str, str]]:
    """The instant backend and a router with gRPC on; yield backend URL, router URL, target."""
    py = sys.executable
    with process([py, "-m", "bench.studies.instant_backend", "--port", "0"]) as backend:
        backend_url = backend.stdout.readline().strip()
        port, grpc_port = free_port(), free_port()
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as cfg:
            cfg.write(f"grpc: {{enabled: true, host: 127.0.0.1, port: {grpc_port}}}\n")
            cfg.flush()
            cmd = [py, "-m", "router", "serve", "-c", cfg.name, "--port", str(port)]
            cmd += ["--backend", backend_url, "--strategy", strategy, "--log-level", "warning"]
            with process(cmd):
                router_url = f"http://127.0.0.1:{port}"
                asyncio.run(wait_ready(router_url))
                yield backend_url, router_url, f"127.0.0.1:{grpc_port}"


async def _timed(one: Callable[[], Awaitable[None]], n: int, concurrency: int) -> list[float]:
    out: list[float] = []

    async def worker(k: int) -> None:
        for _ in range(k):
            t0 = time.perf_counter()
            await one()
            out.append(time.perf_counter() - t0)

    share, extra = divmod(n, concurrency)
    await asyncio.gather(*(worker(share + (i < extra)) for i in range(concurrency)))
    return out


def _http_call(http: aiohttp.ClientSession, url: str, stream: bool) -> Callable:
    body = _STREAM_BODY if stream else PING_BODY

    async def one() -> None:
        async with http.post(url, data=body, headers=JSON_HEADERS) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{url} answered {resp.status}")

    return one


def _grpc_call(api: pb_grpc.InferenceStub, stream: bool) -> Callable:
    async def unary() -> None:
        await api.CreateChatCompletion(_REQUEST, timeout=30)

    async def streamed() -> None:
        async for _ in api.StreamChatCompletion(_REQUEST, timeout=30):
            pass

    return streamed if stream else unary


async def compare(
    direct: str, routed: str, target: str, requests: int, concurrency: int, stream: bool
) -> dict[str, list[float]]:
    """Latencies of `requests` calls on each path, interleaved in 10 rounds."""
    lat: dict[str, list[float]] = {name: [] for name in PATHS}
    conn = aiohttp.TCPConnector(limit=0)
    async with (
        aiohttp.ClientSession(connector=conn) as http,
        grpc.aio.insecure_channel(target) as channel,
    ):
        calls = {
            "direct": _http_call(http, direct + "/v1/chat/completions", stream),
            "http": _http_call(http, routed + "/v1/chat/completions", stream),
            "grpc": _grpc_call(pb_grpc.InferenceStub(channel), stream),
        }
        for one in calls.values():  # warm every path
            await _timed(one, 50, concurrency)
        per = max(1, requests // 10)
        for _ in range(10):
            for name, one in calls.items():
                lat[name] += await _timed(one, per, concurrency)
    return lat


def summarize(lat: dict[str, list[float]]) -> dict[str, float]:
    out = {}
    for q, label in ((0.5, "p50"), (0.99, "p99")):
        d, h, g = (percentile(lat[name], q) * 1e3 for name in PATHS)
        out |= {f"direct_{label}_ms": d, f"http_{label}_ms": h, f"grpc_{label}_ms": g}
        out |= {f"http_added_{label}_ms": h - d, f"grpc_minus_http_{label}_ms": g - h}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser_for(__doc__, 32).parse_args(argv)
    modes = [
        ("unary, sequential", 1, False),
        (f"unary, conc {args.concurrency}", args.concurrency, False),
        ("stream 16, sequential", 1, True),
        (f"stream 16, conc {args.concurrency}", args.concurrency, True),
    ]
    results = {}
    with backend_and_router(args.strategy) as (direct, routed, target):
        for label, conc, stream in modes:
            lat = asyncio.run(compare(direct, routed, target, args.requests, conc, stream))
            results[label] = summarize(lat)
    print(
        f"gRPC vs HTTP ingress, {args.strategy}, {args.requests} requests per path and mode, ",
        end="",
    )
    print(f"cpus={os.cpu_count()}")
    print(
        f"{'mode':22} {'direct p50':>10} {'http p50':>9} {'grpc p50':>9} {'grpc-http':>10} "
        f"{'direct p99':>10} {'http p99':>9} {'grpc p99':>9} {'grpc-http':>10}  (ms)"
    )
    for label, s in results.items():
        print(
            f"{label:22} {s['direct_p50_ms']:10.3f} {s['http_p50_ms']:9.3f} "
            f"{s['grpc_p50_ms']:9.3f} {s['grpc_minus_http_p50_ms']:+10.3f} "
            f"{s['direct_p99_ms']:10.3f} {s['http_p99_ms']:9.3f} {s['grpc_p99_ms']:9.3f} "
            f"{s['grpc_minus_http_p99_ms']:+10.3f}"
        )
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
