"""Pools end to end: stub backends in a preferred and a fallback pool, the router in
front, the openai SDK and aiohttp as clients over real sockets."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import msgspec
import orjson
from openai import AsyncOpenAI

from bench.sim.fleet import start_fleet
from bench.sim.params import SimParams
from router.config import Config, build
from router.control.worker import Router
from tests.router.conftest import sdk_through
from tests.stub_backend import StubBackend

MESSAGES = [{"role": "user", "content": "the same question every time"}]
SIM = "sim-llama-70b"
#: the variant a pool serves SIM as
AWQ = "sim-llama-70b-awq"


ADMIN_TOKEN = "admin-token-for-pool-tests"


@asynccontextmanager
async def two_pools(
    fallback: dict | None = None, **config: object
) -> AsyncIterator[tuple[Router, StubBackend, StubBackend]]:
    """`main` alone in pool `preferred`; `spare` in pool `fallback`, which serves the
    public name stub-model as its own stub-model-awq (`fallback`: more of its keys)."""
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
                **(fallback or {}),
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
        async with AsyncOpenAI(
            base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10
        ) as oai:
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
        async with AsyncOpenAI(
            base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10
        ) as oai:
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


async def test_a_renamed_model_answers_and_is_listed_under_the_name_asked_for(tmp_path) -> None:
    """The openai SDK, compression and capture on, a pool serving sim-llama-70b as its
    own variant (a simulated backend, with a LoRA adapter on the variant)."""
    fleet = await start_fleet(1, SimParams(model=AWQ, lora_adapters=["sql"], time_scale=0.02))
    mapped = {"name": "awq", "priority": 0, "model_map": {SIM: AWQ}}
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{**mapped, "backends": [{"url": fleet.urls[0], "name": "sim-awq"}]}],
        "compression": {"enabled": True, "min_bytes": 1},
        "capture": {"enabled": True, "sample": 1.0, "path": str(tmp_path)},
    }
    args = {"model": SIM, "messages": MESSAGES, "max_tokens": 6}
    async with sdk_through(config, fleet) as oai:
        whole = await oai.chat.completions.with_raw_response.create(**args)
        answer = whole.parse()
        streamed = await oai.chat.completions.with_raw_response.create(
            **args, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in streamed.parse()]
        listed = [m.model_dump() for m in (await oai.models.list()).data]
    for raw in (whole, streamed):
        assert raw.headers["content-encoding"] in ("gzip", "zstd")
    assert answer.model == SIM and answer.choices[0].message.content
    assert len(chunks) >= 7 and [c.model for c in chunks] == [SIM] * len(chunks)
    assert chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    cards = {card["id"]: card for card in listed}
    assert set(cards) == {SIM, "sql"}
    assert (cards[SIM]["root"], cards["sql"]["parent"]) == (SIM, SIM)
    records = [orjson.loads(x) for f in tmp_path.iterdir() for x in f.read_bytes().splitlines()]
    responses = {r["response"].get("stream", False): r["response"] for r in records}
    assert responses[False]["model"] == SIM
    assert responses[True]["content"] == text and responses[True]["events"] >= 7


async def test_only_a_renamed_models_answers_are_rewritten_and_only_their_model(
    handovers: list[bytes],
) -> None:
    """Answers of the preferred pool come byte for byte as the backend sent them; the
    fallback's, whole or streamed, by the fast path's relay or aiohttp's with the
    usage event taken out, differ from its own only in the model they name."""
    whole = {"model": "stub-model", "messages": MESSAGES, "max_tokens": 3}
    stream = {**whole, "stream": True}
    asked = [whole, {**stream, "stream_options": {"include_usage": True}}, stream]
    async with two_pools(usage={"stream_usage": True}) as (router, main, spare):
        async with aiohttp.ClientSession() as http:
            home = [await _answer(http, router.url, body) for body in asked]
            assert home == [("preferred", (await _answer(http, main.url, b))[1]) for b in asked]
            main.behaviour.status = 503
            router.fleet.set_healthy(router.fleet.find("main"), False)
            spilled = [
                await _answer(http, router.url, body, chunked=i == 2)
                for i, body in enumerate(asked)
            ]
            for body, (pool, got) in zip(asked, spilled, strict=True):
                _, own = await _answer(http, spare.url, {**body, "model": "stub-model-awq"})
                assert pool == "fallback" and b"awq" in own and b"awq" not in got
                assert got == re.sub(rb'("model"\s*:\s*)"stub-model-awq"', rb'\1"stub-model"', own)
            async with http.get(router.url + "/v1/models") as resp:
                assert [m["id"] for m in (await resp.json())["data"]] == ["stub-model"]
    assert len(handovers) == 1 and b"data: [DONE]" in spilled[2][1]  # aiohttp's relay
    assert spare.received[2]["stream_options"] == {"include_usage": True}  # taken out


async def test_a_pool_that_exposes_its_model_answers_and_lists_it() -> None:
    async with two_pools({"expose_backend_model": True}) as (router, _, _):
        router.fleet.set_healthy(router.fleet.find("main"), False)
        async with AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as oai:
            args = {"model": "stub-model", "messages": MESSAGES, "max_tokens": 3}
            answer = await oai.chat.completions.create(**args)
            chunks = [c async for c in await oai.chat.completions.create(**args, stream=True)]
            listed = {m.id for m in (await oai.models.list()).data}
    assert answer.model == "stub-model-awq" and {c.model for c in chunks} == {"stub-model-awq"}
    assert listed == {"stub-model", "stub-model-awq"}


async def test_a_name_only_a_renamed_pool_serves_labels_metrics_and_usage_records(
    monkeypatch, tmp_path
) -> None:
    """The client's name, not `(other)`, in the metrics' model label and the usage
    records' model column, though no backend lists it (only its variant)."""
    monkeypatch.setenv("KV_POOLS_ADMIN", ADMIN_TOKEN)
    spare = await StubBackend(model="stub-model-awq").start()
    backend = {"url": spare.url, "name": "spare", "models": ["stub-model-awq"]}
    pool = {"name": "awq", "priority": 0, "model_map": {"stub-model": "stub-model-awq"}}
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{**pool, "backends": [backend]}],
        "usage": {"records": True, "path": str(tmp_path / "u.db"), "interval_s": 0.05},
        "admin": {"port": 0, "token_env": "KV_POOLS_ADMIN"},
    }
    try:
        router = Router(build(data))
        await router.start()
        try:
            rows, page = await _used_and_scraped(router)
        finally:
            await router.stop()
    finally:
        await spare.stop()
    assert [(r["model"], r["pool"], r["requests"]) for r in rows] == [("stub-model", "awq", 1)]
    usage = 'kvroute_usage_requests_total{model="stub-model",pool="awq",tenant="(none)"} 1.0'
    assert usage in page.splitlines()
    assert re.search(r'kvroute_requests_total\{[^}]*model="stub-model"[^}]*\} 1\.0', page)
    assert 'model="(other)"' not in page


async def _used_and_scraped(router: Router) -> tuple[list[dict], str]:
    """One chat request through the SDK, then the usage records once its window is
    written, and the /metrics page."""
    async with AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as oai:
        assert await ask(oai) == ("awq", "spare")
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with asyncio.timeout(10):  # until the window holding it is written
            while True:
                async with http.get(router.admin.url + "/admin/usage") as resp:
                    rows = (await resp.json())["usage"]
                if rows:
                    break
                await asyncio.sleep(0.02)
        async with http.get(router.url + "/metrics") as resp:
            return rows, await resp.text()


async def _answer(
    http: aiohttp.ClientSession, url: str, body: dict, chunked: bool = False
) -> tuple[str, bytes]:
    """The chat answer's pool (from the router) and body; `chunked`: the request's body
    sent in chunks, which aiohttp's server reads (not the fast path)."""
    data = orjson.dumps(body)

    async def pieces() -> AsyncIterator[bytes]:
        yield data[:10]
        yield data[10:]

    headers = {"Content-Type": "application/json"}
    sent = pieces() if chunked else data
    async with http.post(url + "/v1/chat/completions", data=sent, headers=headers) as resp:
        assert resp.status == 200
        return resp.headers.get("x-kvroute-pool", ""), await resp.read()
