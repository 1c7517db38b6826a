"""LoRA adapters loaded on demand: simulated vLLM servers with runtime LoRA updating,
the router in front, the openai SDK as client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import openai
import pytest
from openai import AsyncOpenAI

from bench.sim.fleet import SimFleet, start_fleet
from bench.sim.params import SimParams
from tests.router.conftest import sdk_through
from tests.stub_backend import StubBackend

ADAPTERS = ["sql-lora", "legal-lora", "med-lora"]


@asynccontextmanager
async def lora_fleet(
    n: int, max_loras: int = 4, runtime: bool = True
) -> AsyncIterator[tuple[SimFleet, AsyncOpenAI]]:
    params = SimParams(time_scale=0.01, runtime_lora_updating=runtime, lora_load_ms=100)
    fleet = await start_fleet(n, params)
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": b.url, "name": f"sim{i}"} for i, b in enumerate(fleet.backends)],
        "routing": {"strategy": "LEAST_OUTSTANDING_REQUESTS"},
        "lora": {
            "load_on_demand": True,
            "adapters": ADAPTERS,
            "source": "/models/loras/{name}",
            "max_loras": max_loras,
        },
    }
    async with sdk_through(config, fleet) as oai:
        yield fleet, oai


async def ask(oai: AsyncOpenAI, model: str) -> str:
    raw = await oai.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    assert raw.parse().choices[0].message.content
    return raw.headers["x-kvroute-backend"]


def loads(fleet: SimFleet) -> tuple[int, int]:
    return sum(b.loras.loads for b in fleet.backends), sum(b.loras.unloads for b in fleet.backends)


async def test_concurrent_first_requests_load_the_adapter_once() -> None:
    async with lora_fleet(2) as (fleet, oai):
        served = await asyncio.gather(*(ask(oai, "sql-lora") for _ in range(8)))
        assert loads(fleet) == (1, 0)
        (home,) = set(served)  # only the backend that loaded it serves it
        assert await ask(oai, "sql-lora") == home
        sim = fleet.backends[int(home.removeprefix("sim"))]
        assert sim.loras.names == ["sql-lora"]
        assert (await oai.models.list()).data  # the router still answers /v1/models
        assert loads(fleet) == (1, 0)


async def test_only_the_listed_adapters_are_ever_loaded() -> None:
    async with lora_fleet(1) as (fleet, oai):
        with pytest.raises(openai.NotFoundError):
            await ask(oai, "not-listed-lora")
        assert loads(fleet) == (0, 0)


async def test_a_backend_at_max_loras_unloads_its_least_recently_used() -> None:
    async with lora_fleet(1, max_loras=2) as (fleet, oai):
        await ask(oai, "sql-lora")
        await ask(oai, "legal-lora")
        await ask(oai, "sql-lora")  # used again: legal-lora is now the least recent
        await ask(oai, "med-lora")
        (sim,) = fleet.backends
        assert sorted(sim.loras.names) == ["med-lora", "sql-lora"]
        assert loads(fleet) == (3, 1)
        await ask(oai, "legal-lora")  # loaded again, in place of sql-lora
        assert sorted(sim.loras.names) == ["legal-lora", "med-lora"]
        assert loads(fleet) == (4, 2)


async def test_a_backend_that_cannot_load_is_a_clear_503() -> None:
    async with lora_fleet(1, runtime=False) as (_, oai):
        with pytest.raises(openai.APIStatusError) as info:
            await ask(oai, "sql-lora")
        assert info.value.status_code == 503
        assert "No backend can load the adapter `sql-lora` (sim0: " in info.value.message
        assert "/v1/load_lora_adapter answered 404" in info.value.message


async def test_a_mixed_fleet_loads_where_loading_works_and_remembers_where_not() -> None:
    """A backend whose load answers 404 (no runtime LoRA updating) is tried first (it
    holds no adapter and is listed first), then left out: the next one loads, and the
    next adapter goes there without asking the first again."""
    params = SimParams(time_scale=0.01, runtime_lora_updating=True, lora_load_ms=100)
    plain = await StubBackend(model=params.model).start()
    try:
        fleet = await start_fleet(1, params)
        sim = fleet.backends[0]
        backends = [{"url": plain.url, "name": "plain"}, {"url": sim.url, "name": "sim0"}]
        config = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "backends": backends,
            "routing": {"strategy": "LEAST_OUTSTANDING_REQUESTS"},
            "lora": {"load_on_demand": True, "adapters": ADAPTERS, "source": "/loras/{name}"},
        }
        async with sdk_through(config, fleet) as oai:
            assert await ask(oai, "sql-lora") == "sim0"
            assert plain.lora_loads == 1
            assert await ask(oai, "legal-lora") == "sim0"
            assert plain.lora_loads == 1  # remembered: not asked again
            assert loads(fleet) == (2, 0)
    finally:
        await plain.stop()
