"""Each strategy distributes real requests (OpenAI SDK → router → stub backends) as it should."""

from __future__ import annotations

import asyncio
import collections

from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.router.conftest import running, settle

MODEL = "stub-model"


def client(router) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def chat(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def ask(oai: AsyncOpenAI, messages: list[dict]) -> str:
    raw = await oai.chat.completions.with_raw_response.create(model=MODEL, messages=messages)
    return raw.headers["x-kvroute-backend"]


def served(stubs) -> list[int]:
    return [len(s.received) for s in stubs]


async def test_random_is_roughly_uniform() -> None:
    async with running(3, {"strategy": "RANDOM"}) as (router, stubs):
        async with client(router) as oai:
            for i in range(120):
                await ask(oai, chat("same system prompt", f"q{i}"))
            assert min(served(stubs)) >= 20, served(stubs)  # expected 40 each, ~4 sd margin


async def test_round_robin_takes_turns() -> None:
    async with running(3, {"strategy": "ROUND_ROBIN"}) as (router, _stubs):
        async with client(router) as oai:
            names = [await ask(oai, chat("s", f"q{i}")) for i in range(6)]
            assert names == ["b0", "b1", "b2", "b0", "b1", "b2"]


async def test_least_outstanding_fills_idle_backends_first() -> None:
    async with running(3, {"strategy": "LEAST_OUTSTANDING_REQUESTS"}) as (router, stubs):
        for stub in stubs:
            stub.behaviour.delay = 0.5
        async with client(router) as oai:
            await asyncio.gather(*(ask(oai, chat("s", f"q{i}")) for i in range(6)))
            assert served(stubs) == [2, 2, 2]
            assert [s.max_active for s in stubs] == [2, 2, 2]
            await settle(router)


async def test_least_outstanding_avoids_a_busy_backend() -> None:
    async with running(2, {"strategy": "LEAST_OUTSTANDING_REQUESTS"}) as (router, stubs):
        for stub in stubs:
            stub.behaviour.delay = 1.0
        async with client(router) as oai:
            slow = asyncio.create_task(ask(oai, chat("s", "long one")))
            async with asyncio.timeout(5):
                while not any(s.active for s in stubs):
                    await asyncio.sleep(0.01)
            idle = 1 if stubs[0].active else 0
            stubs[idle].behaviour.delay = 0
            quick = [await ask(oai, chat("s", f"q{i}")) for i in range(5)]
            assert quick == [f"b{idle}"] * 5
            await slow
            await settle(router)


async def test_prefix_aware_pins_prefixes_and_spreads_distinct_ones() -> None:
    routing = {"strategy": "PREFIX_AWARE", "prefix_length": 32}
    async with running(3, routing) as (router, _stubs):
        async with client(router) as oai:
            system = "You are a contract lawyer. " * 20  # far longer than 32 tokens
            pinned = {await ask(oai, chat(system, f"question {i}")) for i in range(15)}
            assert len(pinned) == 1
            owners = collections.Counter(
                [await ask(oai, chat(f"document number {i} " * 12, "summarize")) for i in range(90)]
            )
            assert len(owners) == 3 and min(owners.values()) >= 12, owners  # expected 30 each


async def test_prefix_aware_spills_at_the_threshold() -> None:
    routing = {"strategy": "PREFIX_AWARE", "prefix_length": 16, "concurrency_threshold": 2}
    async with running(3, routing) as (router, stubs):
        for stub in stubs:
            stub.behaviour.delay = 0.5
        async with client(router) as oai:
            messages = chat("hot prefix " * 10, "go")
            owner = await ask(oai, messages)
            names = await asyncio.gather(*(ask(oai, messages) for _ in range(5)))
            counts = collections.Counter(names)
            # the owner takes up to the threshold, then the prefix moves on to the next
            # backend, which keeps it up to the threshold in turn
            assert counts[owner] == 2, counts
            assert sorted(counts.values()) == [1, 2, 2]
            assert max(s.max_active for s in stubs) == 2
            await settle(router)
            spills = {
                s.labels["reason"]: s.value
                for f in text_string_to_metric_families(router.metrics.render().decode())
                if f.name == "kvroute_spillovers"
                for s in f.samples
                if s.name.endswith("_total") and s.value  # not the reasons at 0
            }
            assert spills == {"spill_threshold": 2.0}  # its two moves
