"""Router replicas sharing one view through a real redis-server (config `cluster`).

Each replica is a real `kvroute serve` (a supervisor, its collector and one worker) in
front of the same stub backends; the test sends to each replica over real sockets and
reads what it decided (the backend header, /debug/routing, /metrics). Checked: a prefix
one replica placed is a hit where it was placed for the other; the other replicas' load
is added to a replica's view and dropped once they fall silent; a backend's speed learned
by one replica is used by another that has not learned it; a junk or foreign
message is counted and dropped; with Redis down a request still succeeds and the replica
says it routes alone, and it shares again once Redis is back.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import yaml

from bench.harness.processes import free_port, process, wait_ready
from router.config import APPROXIMATE_BLOCK_SIZE
from router.control.supervisor import RUN_PARENT_ENV
from router.telemetry.cluster_wire import Load, Placed, Speeds
from tests.redis_server import redis_server
from tests.router.test_workers import until
from tests.stub_backend import Behaviour, StubBackend

redis = pytest.importorskip("redis")

CHAT = "/v1/chat/completions"
PREFIX = "t35:"
#: the replicas' block: KV_AWARE's own, without KV events
BLOCK = APPROXIMATE_BLOCK_SIZE


def config(servers: list[StubBackend], redis_url: str | None, **redis: str) -> dict:
    cfg = {
        "listen": {"host": "127.0.0.1"},
        "backends": [{"url": s.url, "name": f"b{i}"} for i, s in enumerate(servers)],
        "routing": {"strategy": "KV_AWARE"},
    }
    if redis_url is not None:
        cfg["cluster"] = {"redis": {"url": redis_url, "key_prefix": PREFIX, **redis}}
    return cfg


@asynccontextmanager
async def replica(
    tmp_path: Path, name: str, cfg: dict, env: dict[str, str] | None = None
) -> AsyncIterator[str]:
    """A `kvroute serve --workers 1` replica (`env`: variables it gets besides ours); its
    URL while it runs."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    runs = tmp_path / f"run-{name}"
    runs.mkdir(exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-m", "router", "serve", "-c", str(path), "--port", str(port)]
    env = {**os.environ, **(env or {}), RUN_PARENT_ENV: str(runs)}
    with process([*cmd, "--workers", "1", "--log-level", "warning"], env=env):
        url = f"http://127.0.0.1:{port}"
        await wait_ready(url, timeout=30)
        yield url


async def metric(http: aiohttp.ClientSession, url: str, name: str, label: str = "") -> float:
    """Sum of every sample of `name` on /metrics, of those with `label` if given."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " ")) and label in line
    )


async def routing(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/debug/routing") as resp:
        return (await resp.json())["backends"]


async def send(http: aiohttp.ClientSession, url: str, prompt: str) -> str:
    body = {"model": "stub-model", "messages": [{"role": "user", "content": prompt}]}
    async with http.post(url + CHAT, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-kvroute-backend"]


def document(n: int) -> str:
    return "".join(f"document {n}, clause {k}: the premises stay in order. " for k in range(40))


async def connected(http: aiohttp.ClientSession, url: str) -> bool:
    return await metric(http, url, "kvroute_cluster_connected") == 1


async def index_keys(http: aiohttp.ClientSession, url: str) -> int:
    return sum(sum(b["index_keys"]) for b in (await routing(http, url)).values())


@pytest.fixture
async def stubs() -> AsyncIterator[list[StubBackend]]:
    servers = [await StubBackend(behaviour=Behaviour()).start() for _ in range(4)]
    yield servers
    for s in servers:
        await s.stop()


async def test_two_replicas_place_new_prefixes_alike_through_redis(tmp_path, stubs) -> None:
    with redis_server(tmp_path) as url:
        async with (
            replica(tmp_path, "a", config(stubs, url)) as a,
            replica(tmp_path, "b", config(stubs, url)) as b,
            aiohttp.ClientSession() as http,
        ):
            await until(lambda: connected(http, a), what="a connected")
            await until(lambda: connected(http, b), what="b connected")
            homes = [await send(http, a, document(n)) for n in range(40)]
            held = await until(lambda: index_keys(http, a), what="a's placements")
            await until(lambda: _at_least(index_keys(http, b), held), what="b to learn them")
            # a's placements counted in its load at once; its next load message says idle
            await until(lambda: _idle(http, b), what="a's load heard idle")
            followed = [await send(http, b, document(n) + " And one more.") for n in range(40)]
            assert followed == homes
            # every follow-up was a predicted hit: b knew where a put each document
            hits = await metric(http, b, "kvroute_policy_decisions_total", 'reason="kv_hit"')
            assert hits == 40


async def _idle(http: aiohttp.ClientSession, url: str) -> bool:
    return not any(b["inflight"] or b["queued_tokens"] for b in (await routing(http, url)).values())


async def _at_least(value, floor: int) -> bool:
    return await value >= floor


@asynccontextmanager
async def replica_heard(
    tmp_path: Path, stubs
) -> AsyncIterator[tuple[str, aiohttp.ClientSession, Any]]:
    """Replica a, connected to its redis-server, with an HTTP session and a Redis client
    that speaks on its channel as another replica (or a stranger) would."""
    with redis_server(tmp_path) as url:
        async with (
            replica(tmp_path, "a", config(stubs, url)) as a,
            aiohttp.ClientSession() as http,
        ):
            await until(lambda: connected(http, a), what="connected")
            db = redis.asyncio.Redis.from_url(url)
            try:
                yield a, http, db
            finally:
                await db.aclose()


async def test_the_other_replicas_load_counts_until_they_fall_silent(tmp_path, stubs) -> None:
    async with replica_heard(tmp_path, stubs) as (a, http, db):
        load = msgspec.msgpack.encode(Load("other", {"b2": (7, 3000)}))

        async def heard() -> bool:
            await db.publish(PREFIX + "feed", load)
            return (await routing(http, a))["b2"]["inflight"] == 7

        await until(heard, what="the other replica's load")
        assert (await routing(http, a))["b2"]["queued_tokens"] == 3000
        assert await metric(http, a, "kvroute_cluster_peers") == 1
        # a placement it makes counts at once, before its next load message
        placed = Placed("other", BLOCK, [("b2", time.time() + 60, [11, 12, 13])])
        await db.publish(PREFIX + "feed", msgspec.msgpack.encode(placed))
        await until(lambda: _inflight_is(http, a, "b2", 8), what="the placement")
        assert (await routing(http, a))["b2"]["queued_tokens"] == 3000 + 3 * BLOCK
        # silent from here on: dropped within PEER_TTL_S and an interval
        silent = time.monotonic()
        await until(lambda: _inflight_is(http, a, "b2", 0), 5, "the silent replica dropped")
        assert time.monotonic() - silent < 2.5


async def test_a_speed_one_replica_learned_is_used_by_the_other(tmp_path) -> None:
    """Only a relays streams to the backend; b, which has seen none, routes by a's
    learned speed (marked shared) rather than the configured one."""
    stub = await StubBackend(behaviour=Behaviour(chunks=12, pace=0.005)).start()
    try:
        with redis_server(tmp_path) as url:
            async with (
                replica(tmp_path, "a", config([stub], url)) as a,
                replica(tmp_path, "b", config([stub], url)) as b,
                aiohttp.ClientSession() as http,
            ):
                await until(lambda: connected(http, a), what="a connected")
                await until(lambda: connected(http, b), what="b connected")
                assert (await routing(http, b))["b0"]["speed_source"] is None

                async def learned() -> dict | None:
                    await stream(http, a)
                    found = (await routing(http, a))["b0"]
                    return found if found["speed_source"] == "learned" else None

                own = await until(learned, 30, "a to learn b0's speed")

                async def shared() -> dict | None:
                    found = (await routing(http, b))["b0"]
                    return found if found["speed_source"] == "shared" else None

                heard = await until(shared, what="b to hear a's speed")
                assert heard["speed_learned"] is False
                assert heard["speed"] == pytest.approx(own["speed"])
    finally:
        await stub.stop()


async def stream(http: aiohttp.ClientSession, url: str) -> None:
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(url + CHAT, json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def _inflight_is(http: aiohttp.ClientSession, url: str, backend: str, n: int) -> bool:
    return (await routing(http, url))[backend]["inflight"] == n


async def test_junk_and_foreign_messages_are_counted_and_dropped(tmp_path, stubs) -> None:
    async with replica_heard(tmp_path, stubs) as (a, http, db):
        malformed = 'outcome="malformed"'
        foreign = 'outcome="foreign"'
        nan = Speeds("other", {"b0": (float("nan"), 0.01, 0.0, 9)})
        for junk in (b"\xff\x00junk", msgspec.msgpack.encode({"type": "placed"}), nan):
            junk = junk if isinstance(junk, bytes) else msgspec.msgpack.encode(junk)
            await db.publish(PREFIX + "feed", junk)
        other = Placed("other", BLOCK // 4, [("b0", time.time() + 60, [1, 2, 3])])
        await db.publish(PREFIX + "feed", msgspec.msgpack.encode(other))
        # another router's channel: never heard
        await db.publish("someone-else:feed", b"\xff")
        counted = "kvroute_cluster_messages_total"
        await until(lambda: _equals(metric(http, a, counted, malformed), 3), what="junk")
        await until(lambda: _equals(metric(http, a, counted, foreign), 1), what="foreign")
        assert await index_keys(http, a) == 0
        assert (await routing(http, a))["b0"]["speed_source"] is None
        assert await send(http, a, document(1))  # still serving
        assert await connected(http, a)


async def _equals(value, expected: float) -> bool:
    return await value == expected


async def test_a_request_succeeds_while_redis_is_down_and_sharing_resumes(tmp_path, stubs) -> None:
    port = free_port()
    first = ExitStack()
    url = first.enter_context(redis_server(tmp_path, port=port))
    try:
        async with (
            replica(tmp_path, "a", config(stubs, url)) as a,
            replica(tmp_path, "b", config(stubs, url)) as b,
            aiohttp.ClientSession() as http,
        ):
            await until(lambda: connected(http, a), what="a connected")
            await until(lambda: connected(http, b), what="b connected")
            first.close()  # Redis stops
            await until(lambda: _equals(metric(http, a, "kvroute_cluster_connected"), 0))
            started = time.monotonic()
            assert await send(http, a, document(1))
            assert time.monotonic() - started < 1.0  # nothing waited on Redis
            with redis_server(tmp_path, port=port):  # restarted where it was
                await until(lambda: connected(http, a), 20, "a reconnected")
                await until(lambda: connected(http, b), 20, "b reconnected")
                before = await index_keys(http, b)
                home = await send(http, a, document(2))
                await until(lambda: _above(index_keys(http, b), before), what="b to learn")
                await until(lambda: _idle(http, b), what="a's load heard idle")
                assert await send(http, b, document(2) + " And one more.") == home
    finally:
        first.close()


async def _above(value, floor: int) -> bool:
    return await value > floor


async def test_the_password_comes_from_the_environment(tmp_path, stubs) -> None:
    """`password_env` opens a password-protected Redis; a wrong one leaves the replica
    routing alone, and serving."""
    with redis_server(tmp_path, password="s3cret") as url:
        cfg = config(stubs, url, password_env="KVROUTE_TEST_REDIS_PASSWORD")
        async with (
            replica(tmp_path, "a", cfg, {"KVROUTE_TEST_REDIS_PASSWORD": "s3cret"}) as a,
            replica(tmp_path, "b", cfg, {"KVROUTE_TEST_REDIS_PASSWORD": "wrong"}) as b,
            aiohttp.ClientSession() as http,
        ):
            await until(lambda: connected(http, a), what="a connected")
            assert await metric(http, b, "kvroute_cluster_connected") == 0
            assert await send(http, b, document(1))
