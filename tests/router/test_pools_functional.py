"""Pools end to end: stub backends in a preferred and a fallback pool, the router in
front, the openai SDK and aiohttp as clients over real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import msgspec
import orjson
from openai import AsyncOpenAI

from router.config import Config, build
from router.control.worker import Router
from tests.stub_backend import StubBackend

MESSAGES = [{"role": "user", "content": "the same question every time"}]


ADMIN_TOKEN = "admin-token-for-pool-tests"


@asynccontextmanager
async def two_pools(**config: object) -> AsyncIterator[tuple[Router, StubBackend, StubBackend]]:
    """`main` alone in pool `preferred`; `spare` in pool `fallback`, which serves the
    public name stub-model as its own stub-model-awq."""
    main = await StubBackend().start()
    spare = await StubBackend(model="stub-model-awq").start()
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [
            {"name": "preferred", "priority": 0, "backends": [{"url": main.url, "name": "main"}]},
            {
                "name": "fallback",
                "priority": 1,
                "model_map": {"stub-model": "stub-model-awq"},
                "backends": [{"url": spare.url, "name": "spare", "models": ["stub-model-awq"]}],
            },
        ],
        "routing": {"strategy": "PREFIX_AWARE", "concurrency_threshold": 1},
        **config,
    }
    router = Router(build(data))
    await router.start()
    try:
        yield router, main, spare
    finally:
        await router.stop()
        await main.stop()
        await spare.stop()


async def ask(oai: AsyncOpenAI, stream: bool = False) -> tuple[str, str]:
    """One request through the SDK, read whole; (pool, backend) from the headers."""
    raw = await oai.chat.completions.with_raw_response.create(
        model="stub-model", messages=MESSAGES, max_tokens=3, stream=stream
    )
    answer = raw.parse()
    if stream:
        assert [c async for c in answer]
    else:
        assert answer.choices[0].message.content
    return raw.headers["x-kvroute-pool"], raw.headers["x-kvroute-backend"]


def counted(router: Router, name: str, **labels: str) -> float:
    family = next(iter(getattr(router.metrics, name).collect()))
    return sum(
        s.value
        for s in family.samples
        if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def pools(router: Router, http: aiohttp.ClientSession) -> dict[str, dict]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with http.get(router.admin.url + "/admin/pools", headers=headers) as resp:
        assert resp.status == 200
        return {p["name"]: p for p in (await resp.json())["pools"]}


async def test_the_fallback_takes_the_overflow_exactly_while_the_preferred_pool_is_full(
    monkeypatch,
) -> None:
    monkeypatch.setenv("KV_ADMIN", ADMIN_TOKEN)
    async with two_pools(admin={"port": 0, "token_env": "KV_ADMIN"}) as (router, main, spare):
        oai = AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10)
        assert await ask(oai) == ("preferred", "main")  # room: the preferred pool
        main.behaviour.hang_after_chunks = 1  # the next stream holds main's one slot
        body = {"model": "stub-model", "messages": MESSAGES, "stream": True}
        async with aiohttp.ClientSession() as http:
            async with http.post(router.url + "/v1/chat/completions", json=body) as held:
                assert held.headers["x-kvroute-pool"] == "preferred"
                assert (await held.content.readline()).startswith(b"data: ")
                assert await ask(oai) == ("fallback", "spare")  # full: the overflow
                assert await ask(oai, stream=True) == ("fallback", "spare")
                full = await pools(router, http)  # one in flight: the preferred pool's
        one = {"backends": 1, "usable": 1}
        assert full["preferred"] == {
            **one, "name": "preferred", "priority": 0, "inflight": 1, "saturation": 1.0,
            "wanted": 1, "removable": 0,
        }  # fmt: skip
        assert full["fallback"] == {
            **one, "name": "fallback", "priority": 1, "inflight": 0, "saturation": 0.0,
            "wanted": 0, "removable": 1,
        }  # fmt: skip
        text = router.metrics.render().decode()
        assert 'kvroute_pool_removable_backends{pool="fallback"} 1.0' in text
        async with asyncio.timeout(5):  # the held stream's slot is given back
            while router.fleet.find("main").inflight:
                await asyncio.sleep(0.01)
        main.behaviour.hang_after_chunks = None
        assert await ask(oai) == ("preferred", "main")  # room again: back home
        assert counted(router, "pool_spills", pool="preferred", reason="saturated") == 2
        assert counted(router, "pool_picks", pool="preferred") == 3
        assert counted(router, "pool_picks", pool="fallback") == 2
        assert [r["model"] for r in spare.received] == ["stub-model-awq"] * 2
        assert spare.completed == 2 and main.completed == 2  # nothing lost


async def test_a_pool_with_its_own_threshold_fills_to_it_before_the_fallback(
    monkeypatch,
) -> None:
    """The fleet's threshold is 1 a backend, the preferred pool's own 2: main takes two
    held streams, and only the third request overflows."""
    monkeypatch.setenv("KV_ADMIN", ADMIN_TOKEN)
    async with two_pools(admin={"port": 0, "token_env": "KV_ADMIN"}) as (router, main, spare):
        await router.reloader.apply(_with_own_threshold(router.config, 2))
        oai = AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10)
        main.behaviour.hang_after_chunks = 1  # streams on main hold their slot
        body = {"model": "stub-model", "messages": MESSAGES, "stream": True}
        url = router.url + "/v1/chat/completions"
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json=body) as one, http.post(url, json=body) as two:
                for held in (one, two):
                    assert held.headers["x-kvroute-pool"] == "preferred"
                    assert (await held.content.readline()).startswith(b"data: ")
                assert await ask(oai) == ("fallback", "spare")
                full = await pools(router, http)
        assert (full["preferred"]["inflight"], full["preferred"]["saturation"]) == (2, 1.0)
        assert counted(router, "pool_spills", pool="preferred", reason="saturated") == 1
        assert spare.completed == 1


def _with_own_threshold(config: Config, threshold: int) -> Config:
    """`config` with the preferred pool's own concurrency_threshold."""
    preferred, fallback = config.pools
    tuned = msgspec.structs.replace(preferred, routing={"concurrency_threshold": threshold})
    return msgspec.structs.replace(config, pools=[tuned, fallback])


async def test_the_model_map_rewrites_the_model_field_and_nothing_else() -> None:
    async with two_pools() as (router, main, spare):
        main.behaviour.status = 503  # a failing preferred backend: its breaker opens
        router.fleet.set_healthy(router.fleet.find("main"), False)  # what checks would do
        body = (
            b'{"messages": [ {"role": "user",   "content": "keep \\u00e9 as sent"} ],'
            b'"model":"stub-model", "max_tokens": 3, "extra": {"b": 1, "a": [1.50, 2]}}'
        )
        headers = {"Content-Type": "application/json"}
        async with aiohttp.ClientSession() as http:
            async with http.post(
                router.url + "/v1/chat/completions", data=body, headers=headers
            ) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvroute-pool"] == "fallback"
        (sent,) = spare.raw
        assert orjson.loads(sent) == {**orjson.loads(body), "model": "stub-model-awq"}
        assert b'[ {"role": "user",   "content": "keep \\u00e9 as sent"} ]' in sent
        assert b'{"b": 1, "a": [1.50, 2]}' in sent
        assert counted(router, "pool_spills", pool="preferred", reason="unavailable") == 1
        async with aiohttp.ClientSession() as http:  # a name no pool serves: still a 404
            unknown = {"model": "nope", "messages": MESSAGES}
            async with http.post(router.url + "/v1/chat/completions", json=unknown) as resp:
                assert resp.status == 404
