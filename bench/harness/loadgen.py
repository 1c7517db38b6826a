"""The load generator: replays a workload as streaming chat requests and times each one.

Per request: POST /v1/chat/completions with `stream: true` and
`stream_options.include_usage`, read as SSE events. TTFT is the time from sending to the
first event with non-empty content; ITL the gaps between later content events that
arrived in different reads (tokens that arrive together make one gap, as in vLLM's own
benchmark); end-to-end the time to `[DONE]`. The usage chunk gives prompt, completion
and cached tokens (`prompt_tokens_details.cached_tokens`); the `x-kvroute-backend`
header names the backend when the target is kvroute, and `X-Request-Id` the request as
kvroute's access log and /debug/routing do (so `--out`'s slow requests can be looked up
there). Bodies ask `ignore_eos` so that a real vLLM, like the simulator, produces
exactly `max_tokens` tokens.

A request fails on a non-200 status, an SSE error event, a stream that ends without
`[DONE]`, a transport error, or the run's deadline; each failure keeps a short reason.

Replicas. Given several URLs (replicas of one router), each request goes to one of them
drawn at random from `seed`, as a load balancer in front of the replicas would spread
them; the same seed draws the same URL for every request, so runs stay comparable.

Scheduling. Open loop (specs carry arrivals): each request leaves at
start + arrival x time_scale whatever the others do. Closed loop: `concurrency` workers,
each sending the next spec when its previous one ended. Either way a spec with turn t > 0
first waits for turn t-1 of its group. The whole replay is bounded by `deadline` seconds:
then requests in flight are cancelled (the server sees a disconnect) and they, and the
ones never sent, count as failed.

Cost: one orjson decode per SSE event, one encode per request, O(1) state per request
(plus its list of gaps).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence

import aiohttp
import msgspec
import orjson

from bench.harness.workloads import RequestSpec
from router.ingress.relay import BACKEND_HEADER
from router.ingress.web import REQUEST_ID

__all__ = ["Outcome", "chat_body", "has_content", "replay"]

_HEADERS = {"Content-Type": "application/json"}
#: the header sglang-router's `manual` policy routes by
SGLANG_ROUTING_KEY = "x-smg-routing-key"
_DATA = b"data: "
_DONE = b"[DONE]"
_EVENT_END = b"\n\n"
_ERROR_CHARS = 200


class Outcome(msgspec.Struct, kw_only=True):
    """What happened to one request; times are wall-clock seconds."""

    index: int
    group: int
    ok: bool = False
    error: str | None = None
    status: int | None = None
    backend: str | None = None
    #: the answer's `X-Request-Id` (kvroute's: what its access log and /debug/routing
    #: name the request by; the peers send none)
    request_id: str | None = None
    sent: float | None = None  # from the start of the replay
    ttft: float | None = None
    itl: list[float] = []
    e2e: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None


def chat_body(spec: RequestSpec, model: str) -> dict:
    """The OpenAI chat request for `spec`: streamed, with usage, exactly max_tokens long."""
    return {
        "model": model,
        "messages": spec.messages,
        "max_tokens": spec.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def replay(
    urls: Sequence[str],
    model: str,
    specs: Sequence[RequestSpec],
    *,
    concurrency: int | None,
    time_scale: float = 1.0,
    deadline: float,
    seed: int = 0,
    on_done: Callable[[Outcome], None] = lambda _: None,
) -> list[Outcome]:
    """Send `specs` to `urls` (server roots, one drawn per request); one Outcome per spec,
    in spec order."""
    outcomes = [Outcome(index=s.index, group=s.group) for s in specs]
    draw = random.Random(f"{seed}/replicas")
    targets = [draw.choice(urls) for _ in specs]
    finished = {(s.group, s.turn): asyncio.Event() for s in specs}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        start = asyncio.get_running_loop().time()

        async def one(spec: RequestSpec) -> None:
            out = outcomes[spec.index]
            try:
                if spec.turn:
                    await finished[(spec.group, spec.turn - 1)].wait()
                body, headers = chat_body(spec, model), request_headers(spec)
                await _send(http, targets[spec.index], body, headers, out, start)
            finally:
                finished[(spec.group, spec.turn)].set()
                on_done(out)

        try:
            async with asyncio.timeout(deadline):
                if concurrency is None:
                    await _open_loop(specs, one, start, time_scale)
                else:
                    await _closed_loop(specs, one, concurrency)
        except TimeoutError:
            pass
    for out in outcomes:
        if not out.ok and out.error is None:
            out.error = "deadline"
    return outcomes


async def _open_loop(
    specs: Sequence[RequestSpec], one: Callable, start: float, time_scale: float
) -> None:
    loop = asyncio.get_running_loop()
    async with asyncio.TaskGroup() as tasks:
        for spec in specs:
            assert spec.arrival is not None, "open loop needs arrivals"
            await asyncio.sleep(start + spec.arrival * time_scale - loop.time())
            tasks.create_task(one(spec))


async def _closed_loop(specs: Sequence[RequestSpec], one: Callable, concurrency: int) -> None:
    pending = iter(specs)

    async def worker() -> None:
        for spec in pending:  # shared: each spec goes to exactly one worker
            await one(spec)

    async with asyncio.TaskGroup() as tasks:
        for _ in range(concurrency):
            tasks.create_task(worker())


def request_headers(spec: RequestSpec) -> dict[str, str]:
    """The headers of `spec`'s request: its session, if it names one, under the names the
    routers compared read (kvroute's and vllm-router's `X-Session-ID`, sglang-router's
    routing key)."""
    if spec.session is None:
        return _HEADERS
    return {**_HEADERS, "X-Session-ID": spec.session, SGLANG_ROUTING_KEY: spec.session}


async def _send(
    http: aiohttp.ClientSession,
    url: str,
    body: dict,
    headers: dict[str, str],
    out: Outcome,
    start: float,
) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    out.sent = t0 - start
    try:
        async with http.post(
            url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers
        ) as resp:
            out.status = resp.status
            out.backend = resp.headers.get(BACKEND_HEADER)
            out.request_id = resp.headers.get(REQUEST_ID)
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:_ERROR_CHARS]}"
                return
            out.error = await _read_stream(resp.content, out, t0)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]
    out.ok = out.error is None


async def _read_stream(content: aiohttp.StreamReader, out: Outcome, t0: float) -> str | None:
    """Fill the timings and usage of `out` from an SSE body; the failure reason or None.

    Reads whatever arrived and splits it into events, so events that came in one read
    share one timestamp (they reached the client together) and cost one await.
    """
    loop = asyncio.get_running_loop()
    last: float | None = None
    pending = b""
    async for data in content.iter_any():
        now = loop.time()
        *events, pending = (pending + data).split(_EVENT_END)
        for event in events:
            if not event.startswith(_DATA):
                continue  # an SSE comment or a field we do not use
            payload = event[len(_DATA) :].strip()
            if payload == _DONE:
                out.e2e = now - t0
                return None
            parsed = orjson.loads(payload)
            if "error" in parsed:
                return f"stream error: {orjson.dumps(parsed['error'])[:_ERROR_CHARS].decode()}"
            if parsed.get("usage"):
                _record_usage(out, parsed["usage"])
            if has_content(parsed):
                if last is None:
                    out.ttft = now - t0
                elif now > last:
                    out.itl.append(now - last)
                last = now
    return "stream ended without [DONE]"


def has_content(event: dict) -> bool:
    """True if a decoded SSE event carries generated text (a chat delta or completion text)."""
    for choice in event.get("choices") or ():
        if (choice.get("delta") or {}).get("content") or choice.get("text"):
            return True
    return False


def _record_usage(out: Outcome, usage: dict) -> None:
    out.prompt_tokens = usage.get("prompt_tokens")
    out.completion_tokens = usage.get("completion_tokens")
    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
