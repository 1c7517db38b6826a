"""What compressing a chat stream costs (CPU per event, memory per stream) and saves
(bytes on the wire), measured in one run with compression off as the baseline.

    python -m bench.studies.compression --tokens 200 --repeats 30

A simulated vLLM server streams a chat answer of `--tokens` tokens (its SSE events as
vLLM frames them, one per token); the events are kept and replayed as the router sends
them to a client, to a transport that only counts bytes:
- baseline: `FastReply.send` per event, as the router's chunk loop does with
  compression off;
- gzip, zstd: `EncodedReply` over the same FastReply, at the config's default levels:
  each event compressed and flushed, the stream's encoder made at its start and its
  trailer written at its end (both counted in the per-event figure).
The variants take turns within each repeat, so the machine's noise falls on all alike;
CPU is process time (time the process was descheduled does not count), per event, the
median of the repeats. The bytes are what reached the transport, chunked framing
included, beside the same body compressed whole (what the flush per event costs).
The simulator's text is a repeating sentence, which compresses better than an answer
would: the `varied` stream replaces each token with 4 random letters, which compress
worse than words do, so the two bracket a real answer.

Memory per open stream: the resident size an encoder adds once it has taken the whole
stream, over 200 encoders, each coding in a fresh process; beside it, an encoder with
the library's default window and tables at the same level.

In a router: `kvroute serve` (one worker, compression on) in front of
`bench.studies.instant_backend --raw`, which writes each stream's events a millisecond apart
(one event per read, as a deployment sees them). Batches of `--streams` streams ask in
turn for identity (the fast path's relay from the connection's callbacks, as with
compression off), gzip and zstd; the router's CPU time (its process tree, from /proc)
per event relayed, the median of `--rounds` batches. This counts what the in-process
figures do not: the relay from the backend connection's callbacks, with the framed
reads it forwards decoded before they are compressed.

Reproduces docs/performance.md, "What compression costs".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Coroutine
from pathlib import Path

import aiohttp
import orjson
import zstandard

from bench.harness.processes import free_port, kvroute_serve, logged, process, wait_routable
from bench.harness.procstat import tree_cpu_seconds
from bench.sim.fleet import start_fleet
from bench.sim.params import SimParams
from bench.studies.instant_backend import MODEL
from router.config import CompressionConfig
from router.ingress.compression import Coding, Compression
from router.ingress.fast_reply import FastReply
from router.ingress.relay import EncodedReply, Reply

CODINGS = ("gzip", "zstd")
#: what the router's batches ask for: identity is the relay with compression off
_ASKED = ("identity", *CODINGS)
_SSE = {"Content-Type": "text/event-stream"}
_MEMORY_STREAMS = 200


class _Counting:
    """A client connection that is always ready and counts what is written to it."""

    writing_paused = False
    on_resume = None

    def __init__(self) -> None:
        self.transport = self
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def is_closing(self) -> bool:
        return False

    def closes(self) -> bool:
        return False

    def close_after_answer(self) -> None:
        pass

    async def drain(self) -> None:
        pass


def _step(coro: Coroutine) -> None:
    """Run a reply's coroutine to its end: on a transport that is always ready it never
    waits, so it ends at its first step, with no event loop in the time measured."""
    try:
        coro.send(None)
    except StopIteration:
        return
    raise RuntimeError("the reply waited on a transport that is always ready")


def replay(events: list[bytes], coding: Coding | None) -> int:
    """One stream of `events` sent as the router sends it; the body's bytes on the wire."""
    client = _Counting()
    reply: Reply = FastReply(client)
    if coding is not None:
        reply = EncodedReply(reply, coding)
    _step(reply.begin(200, _SSE))
    head = client.written
    for event in events:
        reply.send(event)
    _step(reply.end())
    return client.written - head


async def simulated_stream(tokens: int) -> list[bytes]:
    """The SSE events of a chat answer of `tokens` tokens from a simulated vLLM server."""
    fleet = await start_fleet(1, SimParams(time_scale=0.001))
    body = {
        "model": "sim-llama-70b",
        "messages": [{"role": "user", "content": "Tell me about prefix caches."}],
        "max_tokens": tokens,
        "stream": True,
    }
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(fleet.urls[0] + "/v1/chat/completions", json=body) as resp:
                data = await resp.read()
    finally:
        await fleet.stop()
    return [event + b"\n\n" for event in data.split(b"\n\n")[:-1]]


def varied(events: list[bytes], seed: int = 7) -> list[bytes]:
    """`events` with each token's text replaced by 4 random letters (or a space)."""
    rng = random.Random(seed)
    letters = string.ascii_lowercase + " "
    out = []
    for event in events:
        data = event.removeprefix(b"data: ").rstrip(b"\n")
        if data == b"[DONE]":
            out.append(event)
            continue
        chunk = orjson.loads(data)
        delta = chunk["choices"][0]["delta"]
        if delta.get("content"):
            delta["content"] = "".join(rng.choice(letters) for _ in range(4))
        out.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    return out


def codings() -> dict[str, Coding]:
    """Each coding as the default config makes it."""
    compression = Compression(CompressionConfig(enabled=True))
    return {name: compression.choose([name]) for name in CODINGS}


def cpu_per_event(
    events: list[bytes], variants: dict[str, Coding | None], repeats: int
) -> dict[str, float]:
    """Process time per event of each variant, µs: the median over `repeats`."""
    laps = max(1, 4000 // len(events))  # a few thousand events per measurement
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, coding in variants.items():
            began = time.process_time()
            for _ in range(laps):
                replay(events, coding)
            times[name].append((time.process_time() - began) / (laps * len(events)) * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def flushed_bytes(events: list[bytes], coding: Coding) -> int:
    """The compressed body's bytes, flushed after each event, without chunked framing."""
    encoder = coding.stream()
    return sum(len(encoder.compress(event)) for event in events) + len(encoder.finish())


def memory_per_stream(name: str, events: list[bytes]) -> float:
    """KiB an open stream's encoder holds, measured in a fresh process; `name`: a
    coding, or one followed by `-default` (the library's default parameters)."""
    child = subprocess.run(
        [sys.executable, "-m", "bench.studies.compression", "--rss-of", name],
        input=orjson.dumps([e.decode() for e in events]),
        capture_output=True,
        check=True,
    )
    return float(child.stdout)


def _resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def _flushing(name: str) -> Callable[[bytes], bytes]:
    """A new stream encoder's `compress`: the router's, or (`-default`) one with the
    library's default parameters, flushed the same way."""
    coding, _, default = name.partition("-")
    if not default:
        return codings()[coding].stream().compress
    config = CompressionConfig(enabled=True)
    if coding == "gzip":
        z = zlib.compressobj(config.gzip_level, zlib.DEFLATED, 31)
        return lambda chunk: z.compress(chunk) + z.flush(zlib.Z_SYNC_FLUSH)
    zc = zstandard.ZstdCompressor(config.zstd_level).compressobj()
    return lambda chunk: zc.compress(chunk) + zc.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)


def _rss_of(name: str) -> None:
    """The child of `memory_per_stream`: the stream's events on stdin, KiB on stdout."""
    events = [e.encode() for e in orjson.loads(sys.stdin.buffer.read())]
    before, kept = _resident(), []
    for _ in range(_MEMORY_STREAMS):
        compress = _flushing(name)
        for event in events:
            compress(event)
        kept.append(compress)
    print((_resident() - before) / _MEMORY_STREAMS / 1024)


def router_cpu_per_event(streams: int, events: int, rounds: int) -> dict[str, float]:
    """A router's CPU µs per event relayed, by what its clients asked for."""
    backend_cmd = [sys.executable, "-m", "bench.studies.instant_backend", "--raw", "--port", "0"]
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvroute-bench-")))
        backend = stack.enter_context(process([*backend_cmd, "--interval", "0.001"]))
        port = free_port()
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "backends": [{"url": backend.stdout.readline().strip()}],
            "compression": {"enabled": True},
            "access_log": {"enabled": False},
        }
        cmd = [*kvroute_serve(config, tmp / "kvroute.yaml"), "--workers", "1"]
        router = stack.enter_context(logged(cmd, tmp / "kvroute.log"))
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_routable(url, router))
        return asyncio.run(_batches(url, router.pid, streams, events, rounds))


async def _batches(url: str, pid: int, streams: int, events: int, rounds: int):
    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": events,
            "stream": True,
        }
    )
    cpu: dict[str, list[float]] = {asked: [] for asked in _ASKED}
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        for _ in range(rounds):
            for asked in _ASKED:
                before = tree_cpu_seconds(pid)
                await _streams(http, url, body, asked, streams)
                used = tree_cpu_seconds(pid) - before
                cpu[asked].append(used / (streams * (events + 1)) * 1e6)  # [DONE] too
    return {asked: statistics.median(values) for asked, values in cpu.items()}


async def _streams(http: aiohttp.ClientSession, url: str, body: bytes, asked: str, n: int):
    """`n` streams asking for `asked`, 20 at a time; each read whole."""
    headers = {"Accept-Encoding": asked, "Content-Type": "application/json"}
    slots = asyncio.Semaphore(20)

    async def one() -> None:
        async with slots, http.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
            assert r.headers.get("Content-Encoding", "identity") == asked, r.headers
            await r.read()

    await asyncio.gather(*(one() for _ in range(n)))


def report(events: list[bytes], repeats: int) -> list[str]:
    """The tables of one run."""
    offered = codings()
    variants: dict[str, Coding | None] = {"off": None, **offered}
    streams = {"sim": events, "varied": varied(events)}
    lines = [f"A chat stream of {len(events)} SSE events, {len(b''.join(events))} bytes"]
    lines += ["", "stream  coding  CPU µs/event  x off  on the wire  of off"]
    for label, stream in streams.items():
        cpu = cpu_per_event(stream, variants, repeats)
        wire = {name: replay(stream, coding) for name, coding in variants.items()}
        for name in variants:
            lines.append(
                f"{label:7s} {name:6s} {cpu[name]:12.2f} {cpu[name] / cpu['off']:6.1f} "
                f"{wire[name]:11d} {wire[name] / wire['off']:7.1%}"
            )
    lines += [
        "",
        "The body's bytes: flushed per event; the same with the library's default",
        "window and tables (without the trailer, a few bytes); compressed whole, unflushed",
        "stream  coding  per event  defaults  whole",
    ]
    for label, stream in streams.items():
        for name, coding in offered.items():
            default = sum(map(len, map(_flushing(f"{name}-default"), stream)))
            whole = len(coding.whole(b"".join(stream)))
            lines.append(
                f"{label:7s} {name:6s} {flushed_bytes(stream, coding):9d} {default:9d} {whole:6d}"
            )
    lines += ["", "coding  KiB per open stream  library defaults"]
    for name in offered:
        ours, default = (memory_per_stream(n, events) for n in (name, f"{name}-default"))
        lines.append(f"{name:6s}  {ours:19.1f}  {default:16.1f}")
    return lines


def router_report(streams: int, events: int, rounds: int) -> list[str]:
    cpu = router_cpu_per_event(streams, events, rounds)
    lines = [
        f"A router, one worker: {rounds} x {streams} streams of {events} events per coding",
        "",
        "asked     router CPU µs/event  x identity",
    ]
    base = cpu["identity"]  # 0 when a batch used less than /proc's 10 ms tick
    for asked, used in cpu.items():
        ratio = f"{used / base:.2f}" if base else "-"
        lines.append(f"{asked:9s} {used:19.1f} {ratio:>11s}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=200, help="tokens in the answer")
    parser.add_argument("--repeats", type=int, default=30, help="measurements per variant")
    parser.add_argument("--streams", type=int, default=200, help="a router batch's streams")
    parser.add_argument("--rounds", type=int, default=3, help="router batches per coding")
    rss_of = [*CODINGS, *(f"{name}-default" for name in CODINGS)]
    parser.add_argument("--rss-of", choices=rss_of, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_of:
        _rss_of(args.rss_of)
        return
    events = asyncio.run(simulated_stream(args.tokens))
    print("\n".join(report(events, args.repeats)), end="\n\n", flush=True)
    print("\n".join(router_report(args.streams, args.tokens, args.rounds)))


if __name__ == "__main__":
    main()
