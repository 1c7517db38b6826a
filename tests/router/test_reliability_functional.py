"""Chaos on the request path: retries, failover and recovery, with exact accounting.

Real stub backends on 127.0.0.1 are killed, refuse connections, answer 503 or hang;
every request the tests send is bounded and counted (chaos.Tally).
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import orjson

from router.fleet.breaker import BreakerState
from tests.router.chaos import Tally, chat, until
from tests.router.conftest import running, settle

FAST = {
    "health": {"interval": 0.05, "timeout": 2.0, "unhealthy_threshold": 2, "healthy_threshold": 1},
    "breaker": {"failure_threshold": 2, "open_seconds": 0.2, "half_open_successes": 1},
    "retries": {"backoff": 0.001, "backoff_max": 0.01},
}
CHAT_PATH = "/v1/chat/completions"


def _served(stubs) -> list[int]:
    return [len(s.received) for s in stubs]


async def _retries(router) -> dict[tuple[str, str], float]:
    async with aiohttp.ClientSession() as http, http.get(router.url + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvroute_retries_total{"):
            labels, value = line[len("kvroute_retries_total{") :].split("} ")
            pairs = dict(kv.split("=") for kv in labels.split(","))
            out[(pairs["backend"].strip('"'), pairs["reason"].strip('"'))] = float(value)
    return out


async def test_refused_connections_are_retried_elsewhere_and_the_backend_comes_back() -> None:
    async with (
        running(3, {"strategy": "ROUND_ROBIN"}, **FAST) as (router, stubs),
        aiohttp.ClientSession() as http,
    ):
        tally = Tally.new()
        url = router.url + CHAT_PATH
        await stubs[0].kill()
        for _ in range(12):
            reply = await tally.send(http, url, **chat())
            assert reply.headers["x-kvroute-backend"] in {"b1", "b2"}
        assert (await _retries(router))[("b0", "connect")] >= 1
        b0 = router.fleet.members[0]
        assert not b0.usable
        await stubs[0].start()  # back on the same port
        await until(lambda: b0.usable, timeout=5)
        names = {(await tally.send(http, url, **chat())).headers["x-kvroute-backend"]}
        for _ in range(8):
            names.add((await tally.send(http, url, **chat())).headers["x-kvroute-backend"])
        assert "b0" in names
        assert (tally.failed, tally.hung) == (0, 0)
        await settle(router)


async def test_503_is_retried_elsewhere_and_the_backend_comes_back() -> None:
    async with (
        running(2, {"strategy": "ROUND_ROBIN"}, **FAST) as (router, stubs),
        aiohttp.ClientSession() as http,
    ):
        tally = Tally.new()
        url = router.url + CHAT_PATH
        stubs[0].behaviour.status = 503  # vLLM's "queue full"
        for _ in range(10):
            assert (await tally.send(http, url, **chat())).headers["x-kvroute-backend"] == "b1"
        assert (await _retries(router))[("b0", "http_503")] >= 1
        b0 = router.fleet.members[0]
        assert b0.breaker.state is not BreakerState.CLOSED
        stubs[0].behaviour.status = 200
        await until(lambda: b0.breaker.admits, timeout=5)
        served = [(await tally.send(http, url, **chat())).headers["x-kvroute-backend"]]
        for _ in range(5):
            served.append((await tally.send(http, url, **chat())).headers["x-kvroute-backend"])
        assert "b0" in served
        assert (tally.failed, tally.hung) == (0, 0)
        await settle(router)


async def test_retry_budget_is_bounded_and_the_last_answer_passes_through() -> None:
    config = {
        **FAST,
        "retries": {"max_retries": 1, "backoff": 0.001},
        "breaker": {"enabled": False},
    }
    async with running(3, **config) as (router, stubs), aiohttp.ClientSession() as http:
        for stub in stubs:
            stub.behaviour.status = 503
        tally = Tally.new()
        for n in range(1, 6):
            reply = await tally.send(http, router.url + CHAT_PATH, expect=503, **chat())
            assert reply.json()["error"]["message"] == "stub failure"  # the backend's own body
            assert sum(_served(stubs)) == 2 * n  # one retry each, never more
        assert (tally.failed, tally.hung) == (0, 0)
        await settle(router)


async def test_a_timeout_is_never_retried_and_a_lone_refusing_backend_is_a_503() -> None:
    config = {**FAST, "timeouts": {"first_byte": 0.3}}
    async with running(2, {"strategy": "ROUND_ROBIN"}, **config) as (router, stubs):
        tally = Tally.new()
        stubs[0].behaviour.hang_before_headers = True
        async with aiohttp.ClientSession() as http:
            reply = await tally.send(http, router.url + CHAT_PATH, expect=504, **chat())
        assert reply.json()["error"]["type"] == "GatewayTimeoutError"
        assert _served(stubs) == [1, 0]  # b1 never saw it: the generation may be running
        await settle(router)
    async with running(1, **FAST) as (router, stubs), aiohttp.ClientSession() as http:
        await stubs[0].kill()
        reply = await tally.send(http, router.url + CHAT_PATH, expect=503, **chat())
        assert "b0" in reply.json()["error"]["message"]  # every candidate failed: wait, retry
        assert "refused the connection" in reply.json()["error"]["message"]
        assert reply.headers["Retry-After"] == "1"
        await settle(router)
    assert (tally.failed, tally.hung) == (0, 0)


async def test_prefix_aware_retries_on_the_prefix_ring_order() -> None:
    routing = {"strategy": "PREFIX_AWARE", "concurrency_threshold": None}
    async with running(4, routing, **FAST) as (router, stubs), aiohttp.ClientSession() as http:
        policy = router.fleet.policy
        prompt = "a prompt whose prefix has an owner " * 4
        fp = policy.fingerprinter.prompt("stub-model", None, prompt)
        ring = policy._ring
        order = [ring.members[i] for i in ring.walk(fp)]
        owner = int(order[0][1:])
        stubs[owner].behaviour.status = 503
        tally = Tally.new()
        body = {"json": {"model": "stub-model", "prompt": prompt}}
        reply = await tally.send(http, router.url + "/v1/completions", **body)
        assert reply.headers["x-kvroute-backend"] == order[1]  # the next on the ring
        assert (tally.failed, tally.hung) == (0, 0)
        await settle(router)


async def test_backend_killed_mid_stream_ends_cleanly_and_is_not_retried() -> None:
    async with (
        running(2, {"strategy": "ROUND_ROBIN"}, **FAST) as (router, stubs),
        aiohttp.ClientSession() as http,
    ):
        stubs[0].behaviour.chunks, stubs[0].behaviour.pace = 50, 0.05
        tally = Tally.new()
        url = router.url + CHAT_PATH

        async def kill_after_first_chunk() -> None:
            await until(lambda: len(stubs[0].chunk_sent_at) >= 2)
            await stubs[0].kill()

        killer = asyncio.create_task(kill_after_first_chunk())
        reply = await tally.send(http, url, **chat(stream=True))
        await killer
        events = reply.events()
        assert events[0].startswith(b"{") and b"tok0" in events[0]
        error = orjson.loads(events[-2])["error"]
        assert error["code"] == 502 and events[-1] == b"[DONE]"
        assert _served(stubs) == [1, 0]  # no second generation after the stream began
        for _ in range(4):  # the router keeps serving
            assert (await tally.send(http, url, **chat())).headers["x-kvroute-backend"] == "b1"
        await settle(router)
        assert all(b.inflight == 0 for b in router.fleet.members)
        assert (tally.failed, tally.hung) == (0, 0)


async def test_accounting_stays_exact_under_mixed_failures() -> None:
    """Concurrent requests while backends refuse, answer 503, cut streams, or are
    abandoned by their clients: every in-flight count returns to zero, never below."""
    config = {**FAST, "breaker": {"enabled": False}, "retries": {"max_retries": 3}}
    async with running(4, **config) as (router, stubs), aiohttp.ClientSession() as http:
        await stubs[0].kill()
        stubs[1].behaviour.status = 503
        stubs[2].behaviour.chunks, stubs[2].behaviour.cut_after_chunks = 4, 2
        stubs[3].behaviour.chunks, stubs[3].behaviour.pace = 4, 0.01
        tally = Tally.new()
        low = [0]

        def watch() -> bool:
            low[0] = min(low[0], *(b.inflight for b in router.fleet.members))
            return False

        async def one(i: int) -> None:
            send = tally.send(http, router.url + CHAT_PATH, expect=None, **chat(stream=i % 2 == 0))
            if i % 5 == 0:  # a client that gives up early
                task = asyncio.create_task(send)
                await asyncio.sleep(random.uniform(0, 0.02))
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            else:
                reply = await send
                assert reply.status == 200, reply.body

        watcher = asyncio.create_task(until(watch, timeout=30, step=0.001))
        await asyncio.gather(*(one(i) for i in range(60)))
        await settle(router)
        watcher.cancel()
        assert low[0] >= 0
        assert router.dispatcher.active == 0 and router.dispatcher.admission.queued == 0
        assert all(b.inflight == 0 and b.queued_tokens == 0 for b in router.fleet.members)
        assert tally.hung == 0
