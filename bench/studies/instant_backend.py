"""A trivial OpenAI-shaped backend that answers instantly: the baseline for overhead runs.

It does no work per request beyond reading the body, so any latency added on top of it
is the router's. Streams send `--chunks` SSE events back to back.

`--raw` serves the same answers from a bare asyncio protocol instead of aiohttp (no
request parser, no request object, several times aiohttp's requests per second), so a
throughput benchmark measures the router rather than the backend. Its streams are paced
like a vLLM decode loop: one timer per pace writes the next event of every open stream
at once, `max_tokens` (or `max_completion_tokens`) events per stream (`--chunks` when the
body names neither), then `data: [DONE]`. The model picks the pace: `instant` streams an
event every `--interval` seconds (0: every loop turn), `instant-slow` every
`--slow-interval`, to hold many streams open cheaply. With `--hold N` (`--slow-hold N`)
a pace's streams send their first event at once and the rest only once N of them are
open: a start line, so a test knows all N were open at one moment, and a benchmark
opens its streams before the events flow (a saturated router may starve new requests).
A stream whose reader is slow is paused (transport flow control), never buffered
without bound. `GET /debug/streams` counts the open streams per model.

Both serve `GET /metrics`: a vLLM page (the simulator's series and histograms, at rest),
so that a router scrapes and parses what it would in front of vLLM. Its KV cache size
(`num_gpu_blocks`) is the simulator's, 384k tokens, unless `--kv-tokens` says otherwise:
a router bounds what its index keeps per backend by it.

    python -m bench.studies.instant_backend --port 0     # prints the URL it listens on
    python -m bench.studies.instant_backend --raw --interval 0.01 --slow-interval 0.5
    python -m bench.studies.instant_backend --sites 64   # 64 URLs: one backend each
    python -m bench.studies.instant_backend --raw --sites 1024

Not a study of its own: the backend of docs/performance.md, "Throughput beside the Rust
routers", "New requests while streams flow", "What compression costs" and the overhead
sections (bench.studies.throughput, fairness, compression, overhead, grpc_overhead), of
"Index memory per host" (bench.studies.index_memory, with `--sites`) and of "A fleet at
rest" (bench.studies.fleet_upkeep, `--raw --sites`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys

import orjson
import uvloop
from aiohttp import web

from bench.sim.metrics import CONTENT_TYPE, SimMetrics
from bench.sim.params import SimParams

MODEL = "instant"
_COMPLETION = orjson.dumps(
    {
        "id": "chatcmpl-0",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
)
_CHUNK = (
    b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":0,"model":"instant",'
    b'"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'
)
_MODELS = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
#: the KV cache a backend shows by default: the simulator's
KV_TOKENS = SimParams().num_gpu_blocks * SimParams().block_size


def metrics_page(kv_tokens: int = KV_TOKENS) -> bytes:
    """What a vLLM server's /metrics shows at rest, with a KV cache of `kv_tokens`."""
    block = SimParams().block_size
    return SimMetrics(SimParams(model=MODEL, num_gpu_blocks=max(2, kv_tokens // block))).render()


def make_app(chunks: int, kv_tokens: int = KV_TOKENS) -> web.Application:
    page = metrics_page(kv_tokens)

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if b'"stream":true' not in body.replace(b" ", b""):
            return web.Response(body=_COMPLETION, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(chunks):
            await response.write(_CHUNK)
        await response.write(b"data: [DONE]\n\n")
        return response

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=_MODELS, content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=page, headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.add_routes(
        [
            web.post("/v1/chat/completions", generate),
            web.post("/v1/completions", generate),
            web.get("/v1/models", models),
            web.get("/metrics", metrics),
            web.get("/health", lambda r: web.Response()),
        ]
    )
    return app


async def serve(host: str, port: int, chunks: int, sites: int, kv_tokens: int) -> None:
    """Serve on `port` and `sites - 1` more free ports, printing each URL on a line."""
    runner = web.AppRunner(make_app(chunks, kv_tokens), access_log=None)
    await runner.setup()
    for i in range(sites):
        await web.TCPSite(runner, host, port if i == 0 else 0, reuse_address=True).start()
    for address in runner.addresses:
        print(f"http://{host}:{address[1]}", flush=True)
    await asyncio.Event().wait()


# --raw: the same answers from a bare protocol ------------------------------------------

SLOW_MODEL = "instant-slow"
_DONE = b"data: [DONE]\n\n"
_GENERATE = frozenset({b"/v1/chat/completions", b"/v1/completions"})
_RAW_MODELS = orjson.dumps(
    {"object": "list", "data": [{"id": m, "object": "model"} for m in (MODEL, SLOW_MODEL)]}
)


def _http(status: bytes, body: bytes, ctype: bytes = b"application/json") -> bytes:
    head = b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
    return head % (status, ctype, len(body)) + body


_RAW_COMPLETION = _http(b"200 OK", _COMPLETION)
_RAW_MODELS_OK = _http(b"200 OK", _RAW_MODELS)
_RAW_HEALTH = _http(b"200 OK", b"", b"text/plain")


@functools.cache
def _raw_metrics(kv_tokens: int) -> bytes:
    return _http(b"200 OK", metrics_page(kv_tokens), CONTENT_TYPE.encode())


_RAW_NOT_FOUND = _http(b"404 Not Found", b'{"error":{"message":"no such path"}}')
_RAW_BAD = _http(b"400 Bad Request", b"").replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_EVENT = b"%x\r\n%s\r\n" % (len(_CHUNK), _CHUNK)
_LAST = b"%x\r\n%s\r\n0\r\n\r\n" % (len(_DONE), _DONE)  # [DONE], then the chunked end


def _content_length(head: bytes) -> int:
    at = head.find(b"\r\ncontent-length:")
    if at < 0:
        return 0
    end = head.find(b"\r\n", at + 2)
    return int(head[at + 17 : end if end >= 0 else len(head)])


class Pace:
    """The open streams of one pace: each tick writes the next event of every stream
    that is not paused, as one decode step of a vLLM server would. Ticks keep a fixed
    cadence (a late tick is not made up for by a burst), start once `hold` streams are
    open and stop when none is. Cost per tick: O(open streams)."""

    def __init__(self, interval: float, hold: int) -> None:
        self.interval = interval
        self.hold = hold
        self.streams: set[RawHTTP] = set()
        self._timer: asyncio.Handle | None = None
        self._due = 0.0

    def add(self, stream: RawHTTP) -> None:
        self.streams.add(stream)
        if self._timer is None and len(self.streams) >= self.hold:
            self._due = asyncio.get_running_loop().time()
            self._schedule()

    def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        self._due = max(self._due + self.interval, loop.time())
        self._timer = loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        finished = [s for s in list(self.streams) if not s.paused and s.next_event()]
        for stream in finished:
            self.streams.discard(stream)
            stream.stream_done()
        self._timer = None
        if self.streams:
            self._schedule()


class RawHTTP(asyncio.Protocol):
    """HTTP/1.1 keep-alive with just enough parsing for the routes above."""

    def __init__(self, paces: dict[str, Pace], chunks: int, metrics: bytes = b"") -> None:
        self._paces, self._chunks = paces, chunks
        self._metrics = metrics or _raw_metrics(KV_TOKENS)
        self._buf = bytearray()
        self._pace: Pace | None = None
        self._close = False
        self.left = 0
        self.paused = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self._pace is not None:
            self._pace.streams.discard(self)
            self._pace = None

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while self._pace is None and not self._close:  # a stream holds the connection
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            length = _content_length(head)
            if len(buf) < end + 4 + length:
                return
            body = bytes(buf[end + 4 : end + 4 + length])
            del buf[: end + 4 + length]
            self._close = b"\r\nconnection: close" in head
            self._answer(head[: head.find(b"\r\n")].split(b" "), body)

    def _answer(self, line: list[bytes], body: bytes) -> None:
        method, path = (line[0], line[1]) if len(line) == 3 else (b"", b"")
        if method == b"post" and path in _GENERATE:
            if b'"stream":true' in body or b'"stream": true' in body:
                return self._open_stream(body)
            self._reply(_RAW_COMPLETION)
        elif method == b"get" and path == b"/v1/models":
            self._reply(_RAW_MODELS_OK)
        elif method == b"get" and path == b"/health":
            self._reply(_RAW_HEALTH)
        elif method == b"get" and path == b"/metrics":
            self._reply(self._metrics)
        elif method == b"get" and path == b"/debug/streams":
            self._reply(_http(b"200 OK", orjson.dumps(stream_counts(self._paces))))
        elif method in (b"get", b"post"):
            self._reply(_RAW_NOT_FOUND)
        else:  # e.g. an HTTP/2 preface: not for us
            self._close = True
            self._reply(_RAW_BAD)

    def _reply(self, data: bytes) -> None:
        self.transport.write(data)
        if self._close:
            self.transport.close()

    def _open_stream(self, body: bytes) -> None:
        req = orjson.loads(body)
        self.left = req.get("max_tokens") or req.get("max_completion_tokens") or self._chunks
        self._pace = self._paces.get(req.get("model"), self._paces[MODEL])
        self.transport.write(_STREAM_HEAD)
        if self.next_event():
            self.stream_done()
        else:
            self._pace.add(self)

    def next_event(self) -> bool:
        """Write the next event (and the end after the last); True once finished."""
        self.left -= 1
        if self.left > 0:
            self.transport.write(_EVENT)
            return False
        self.transport.write(_EVENT + _LAST if self.left == 0 else _LAST)
        return True

    def stream_done(self) -> None:
        self._pace = None
        if self._close:
            self.transport.close()
        elif self._buf:
            self.data_received(b"")


def stream_counts(paces: dict[str, Pace]) -> dict[str, int]:
    """`GET /debug/streams`: open streams per model (0 once a router let go of them)."""
    return {model: len(pace.streams) for model, pace in paces.items()}


async def serve_raw(
    host: str, port: int, chunks: int, paces: dict[str, Pace], sites: int, kv_tokens: int
) -> None:
    """Serve on `port` and `sites - 1` more free ports (their streams paced together),
    printing each URL on a line."""
    loop = asyncio.get_running_loop()
    metrics = _raw_metrics(kv_tokens)
    for i in range(sites):
        server = await loop.create_server(
            lambda: RawHTTP(paces, chunks, metrics),
            host,
            port if i == 0 else 0,
            reuse_address=True,
            backlog=4096,
        )
        print(f"http://{host}:{server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--chunks", type=int, default=16, help="SSE events per stream")
    parser.add_argument("--raw", action="store_true", help="bare protocol, paced streams")
    parser.add_argument(
        "--interval", type=float, default=0.0, help=f"--raw: seconds between events ({MODEL})"
    )
    parser.add_argument(
        "--slow-interval", type=float, default=0.5, help=f"--raw: the same for {SLOW_MODEL}"
    )
    parser.add_argument(
        "--hold",
        type=int,
        default=0,
        metavar="N",
        help=f"--raw: {MODEL} streams send their second event once N are open",
    )
    parser.add_argument("--slow-hold", type=int, default=0, metavar="N", help="the same, slow")
    parser.add_argument(
        "--sites",
        type=int,
        default=1,
        metavar="N",
        help="listen on N ports, a URL printed per line: N backends to a router",
    )
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=KV_TOKENS,
        metavar="N",
        help=f"the KV cache /metrics shows, in tokens (default {KV_TOKENS:,}, the simulator's)",
    )
    args = parser.parse_args(argv)
    if args.raw:
        paces = {
            MODEL: Pace(args.interval, args.hold),
            SLOW_MODEL: Pace(args.slow_interval, args.slow_hold),
        }
        uvloop.run(serve_raw(args.host, args.port, args.chunks, paces, args.sites, args.kv_tokens))
    else:
        uvloop.run(serve(args.host, args.port, args.chunks, args.sites, args.kv_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
