"""Prefill/decode disaggregation end to end: simulated vLLM servers in prefill and decode
roles (NixlConnector's kv_transfer_params), the router in front, the openai SDK as
client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import openai
import orjson
import pytest
from openai import AsyncOpenAI

from bench.sim.fleet import SimFleet, start_fleet
from bench.sim.params import Fault, SimParams
from tests.router.conftest import sdk_through

MODEL = "sim-llama-70b"
DOC = "".join(f"clause {k}: the tenant keeps the premises in good order. " for k in range(60))


@asynccontextmanager
async def pd_fleet(
    pools: list[tuple[str, str]], extra: dict | None = None, served_as: str | None = None
) -> AsyncIterator[tuple[SimFleet, AsyncOpenAI]]:
    """One simulated backend per (pool name, role), the pools in that priority order;
    `served_as`: the backends serve only that name, which every pool's `model_map`
    gives MODEL (vLLM's 404 for any other name)."""
    roles = [role for _, role in pools]
    params = SimParams(model=served_as or MODEL, time_scale=0.05)
    fleet = await start_fleet(len(pools), params, roles=roles)
    backends = [[{"url": b.url, "name": f"sim{i}"}] for i, b in enumerate(fleet.backends)]
    renamed = {"model_map": {MODEL: served_as}} if served_as else {}
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [
            {"name": name, "priority": i, "role": role, "backends": backends[i], **renamed}
            for i, (name, role) in enumerate(pools)
        ],
        "health": {"interval": 60},  # a backend killed here stays "usable": the retry is tested
        **(extra or {}),
    }
    async with sdk_through(config, fleet) as oai:
        yield fleet, oai


async def debug_routing(oai: AsyncOpenAI) -> dict:
    url = str(oai.base_url).rstrip("/").removesuffix("/v1") + "/debug/routing"
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as resp:
            return await resp.json()


async def ask(oai: AsyncOpenAI, stream: bool = False) -> tuple[str, str, int, int]:
    """(pool, backend, prompt tokens, completion tokens) of one answer read whole."""
    messages = [{"role": "system", "content": DOC}, {"role": "user", "content": "summarise"}]
    raw = await oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=5, stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )  # fmt: skip
    answer = raw.parse()
    if stream:
        chunks = [c async for c in answer]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        text, usage = answer.choices[0].message.content, answer.usage
    assert text
    pool, backend = raw.headers["x-kvroute-pool"], raw.headers["x-kvroute-backend"]
    return pool, backend, usage.prompt_tokens, usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_then_decode_with_the_usage_of_a_whole_request(
    stream: bool, tmp_path
) -> None:
    log = tmp_path / "access.log"
    pools = [("prefill", "prefill"), ("decode", "decode")]
    logged = {"access_log": {"path": str(log)}, "log_format": "json"}
    async with pd_fleet(pools, logged) as (fleet, oai):
        pool, backend, prompt, completion = await ask(oai, stream)
        assert (pool, backend, completion) == ("decode", "sim1", 5)
        prefill, decode = fleet.backends
        assert prefill.stats.prefills_for_remote_decode == 1
        assert decode.stats.decodes_from_remote_prefill == 1
        assert decode.stats.kv_transfer_tokens == prompt - 1  # vLLM recomputes the last
        assert prefill.stats.prompt_tokens == prompt  # the prefill saw the whole prompt
        debug = await debug_routing(oai)
        (decided,) = debug["decisions"]  # the prefill pick, scored by KV_AWARE
        assert decided["chosen"] == "sim0" and decided["scores"].keys() == {"sim0"}
        ((_, decoded),) = [(d.pop("at"), d) for d in debug["decodes"]]
        assert decoded == {"model": MODEL, "prefilled_on": "sim0", "chosen": "sim1"}
    (line,) = [orjson.loads(x) for x in log.read_bytes().splitlines()]  # flushed at stop
    assert (line["backend"], line["prefill"], line["prompt_tokens"]) == ("sim1", "sim0", prompt)


@pytest.mark.parametrize("stream", [False, True])
async def test_both_legs_send_the_name_the_pools_model_map_gives(stream: bool) -> None:
    """Backends that serve MODEL only as a variant (any other name is a 404): the
    prefill leg, like the decode leg, asks for the variant."""
    pools = [("prefill", "prefill"), ("decode", "decode")]
    async with pd_fleet(pools, served_as=MODEL + "-awq") as (fleet, oai):
        pool, backend, prompt, completion = await ask(oai, stream)
        assert (pool, backend, completion) == ("decode", "sim1", 5)
        prefill, decode = fleet.backends
        assert prefill.stats.prefills_for_remote_decode == 1
        assert decode.stats.decodes_from_remote_prefill == 1
        assert decode.stats.kv_transfer_tokens == prompt - 1


async def test_the_decode_pick_is_timed_as_a_decision_of_its_own() -> None:
    """A slow prefill (about half a second here) is not in the routing decision
    histogram: its two observations (prefill pick, decode pick) stay far below it."""
    async with pd_fleet([("prefill", "prefill"), ("decode", "decode")]) as (fleet, oai):
        fleet.backends[0].set_fault(Fault(mode="slow", factor=50.0))
        await ask(oai)
        text = await metrics(oai)
        stats = fleet.backends[0].stats
        assert stats.prefills_for_remote_decode == 1
    (count,) = [
        float(x.split()[-1]) for x in text.splitlines() if x.startswith(_DECISIONS + "_count")
    ]
    (total,) = [
        float(x.split()[-1]) for x in text.splitlines() if x.startswith(_DECISIONS + "_sum")
    ]
    assert count == 2
    assert total < 0.1, total


_DECISIONS = "kvroute_routing_decision_seconds"


async def test_a_prefill_backend_killed_mid_request_is_retried_on_another() -> None:
    pools = [("p-first", "prefill"), ("p-second", "prefill"), ("decode", "decode")]
    async with pd_fleet(pools) as (fleet, oai):
        first, second, decode = fleet.backends
        first.set_fault(Fault(mode="slow", factor=1000.0))  # holds the prefill
        answer = asyncio.create_task(ask(oai))
        async with asyncio.timeout(10):  # the prefill leg reached the first backend
            while not first.inflight:
                await asyncio.sleep(0.01)
        await first.stop()  # killed while it holds the request
        pool, backend, _, completion = await answer
        assert (pool, backend, completion) == ("decode", "sim2", 5)
        assert second.stats.prefills_for_remote_decode == 1
        assert decode.stats.decodes_from_remote_prefill == 1


async def test_failing_prefills_open_the_backends_breaker() -> None:
    """A prefill backend answering 503 is retried on the other each time, and its
    breaker hears each failure: after two it opens and prefills stop going there."""
    pools = [("p-bad", "prefill"), ("p-good", "prefill"), ("decode", "decode")]
    extra = {"breaker": {"failure_threshold": 2}, "routing": {"strategy": "RANDOM", "seed": 3}}
    async with pd_fleet(pools, extra) as (fleet, oai):
        bad, good, _ = fleet.backends
        bad.set_fault(Fault(mode="fail", status=503))
        for _ in range(40):  # bounded: RANDOM tries the bad one first half the time
            assert (await ask(oai))[0] == "decode"
            if 'state="open"} 1.0' in _circuit(await metrics(oai), "sim0"):
                break
        else:
            raise AssertionError("the breaker of the failing prefill backend never opened")
        served = good.stats.prefills_for_remote_decode
        for _ in range(5):  # open: every prefill goes to the good one first
            await ask(oai)
        assert good.stats.prefills_for_remote_decode == served + 5
        assert bad.stats.prefills_for_remote_decode == 0


async def metrics(oai: AsyncOpenAI) -> str:
    url = str(oai.base_url).rstrip("/").removesuffix("/v1") + "/metrics"
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return await resp.text()


def _circuit(text: str, backend: str) -> str:
    """The kvroute_backend_circuit_state lines of `backend`."""
    mark = f'kvroute_backend_circuit_state{{backend="{backend}",'
    return "\n".join(x for x in text.splitlines() if x.startswith(mark))


@pytest.mark.parametrize("whole", [True, False])
async def test_with_every_prefill_failing_a_whole_pool_serves_or_it_is_a_502(whole) -> None:
    pools = [("prefill", "prefill"), ("decode", "decode")] + [("whole", "both")] * whole
    async with pd_fleet(pools) as (fleet, oai):
        fleet.backends[0].set_fault(Fault(mode="fail", status=500))
        if whole:
            pool, backend, _, _ = await ask(oai)
            assert (pool, backend) == ("whole", "sim2")
            assert fleet.backends[2].stats.decodes_from_remote_prefill == 0
        else:
            with pytest.raises(openai.APIStatusError) as info:
                await ask(oai)
            assert info.value.status_code == 502
            assert "The prefill failed on every prefill backend tried" in info.value.message
            headers = info.value.response.headers
            assert (headers["x-kvroute-backend"], headers["x-kvroute-pool"]) == ("sim0", "prefill")
        assert fleet.backends[1].stats.requests_received == 0


async def test_a_decode_that_fails_before_its_first_byte_is_served_whole() -> None:
    pools = [("prefill", "prefill"), ("decode", "decode"), ("whole", "both")]
    async with pd_fleet(pools) as (fleet, oai):
        prefill, decode, whole = fleet.backends
        decode.set_fault(Fault(mode="fail", status=503))
        pool, backend, _, completion = await ask(oai, stream=True)
        assert (pool, backend, completion) == ("whole", "sim2", 5)
        assert prefill.stats.prefills_for_remote_decode == 1
        assert decode.stats.requests_received == 0  # refused by its fault
        assert whole.stats.decodes_from_remote_prefill == 0  # served whole, no transfer
