"""A trivial OpenAI-shaped backend that answers instantly: the baseline for overhead runs.

It does no work per request beyond reading the body, so any latency added on top of it
is the router's. Streams send `--chunks` SSE events back to back.

    python -m bench.instant_backend --port 0     # prints the URL it listens on
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import orjson
import uvloop
from aiohttp import web

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


def make_app(chunks: int) -> web.Application:
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

    app = web.Application()
    app.add_routes(
        [
            web.post("/v1/chat/completions", generate),
            web.post("/v1/completions", generate),
            web.get("/v1/models", models),
            web.get("/health", lambda r: web.Response()),
        ]
    )
    return app


async def serve(host: str, port: int, chunks: int) -> None:
    runner = web.AppRunner(make_app(chunks), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    print(f"http://{host}:{runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--chunks", type=int, default=16, help="SSE events per stream")
    args = parser.parse_args(argv)
    uvloop.run(serve(args.host, args.port, args.chunks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
