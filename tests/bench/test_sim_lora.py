"""Runtime LoRA loading on the simulator: vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter over real sockets, with the adapter served only once loaded."""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
import openai
import pytest

from bench.sim import SimFleet, SimParams, start_fleet

pytestmark = pytest.mark.timeout(30)

MODEL = "sim-llama-70b"
RUNTIME = SimParams(
    time_scale=0.01,
    num_gpu_blocks=256,
    max_model_len=2048,
    runtime_lora_updating=True,
    lora_adapters=["static-lora"],
    max_loras=3,
)
MESSAGES = [{"role": "user", "content": "Which adapter answers me?"}]
TIMEOUT = aiohttp.ClientTimeout(total=10)


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with await start_fleet(1, RUNTIME) as f:
        yield f


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        yield s


async def _lora(
    http: aiohttp.ClientSession, url: str, action: str, body: dict[str, Any]
) -> tuple[int, str]:
    async with http.post(f"{url}/v1/{action}_lora_adapter", json=body) as r:
        return r.status, await r.text()


async def _load(http: aiohttp.ClientSession, url: str, name: str) -> tuple[int, str]:
    return await _lora(http, url, "load", {"lora_name": name, "lora_path": f"/adapters/{name}"})


async def _unload(http: aiohttp.ClientSession, url: str, name: str) -> tuple[int, str]:
    return await _lora(http, url, "unload", {"lora_name": name})


async def _cards(http: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    async with http.get(f"{url}/v1/models") as r:
        return {card["id"]: card for card in (await r.json())["data"]}


async def _chat_status(http: aiohttp.ClientSession, url: str, model: str) -> int:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 2}
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        return r.status


async def _stats(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/sim/stats") as r:
        return await r.json()


async def _eventually(check: Callable[[], Any], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_load_serve_unload(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    status, text = await _load(http, url, "sql-lora")
    assert (status, text) == (200, "Success: LoRA adapter 'sql-lora' added successfully.")
    card = (await _cards(http, url))["sql-lora"]
    assert (card["parent"], card["root"]) == (MODEL, "/adapters/sql-lora")

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sim", max_retries=0)
    try:
        answer = await client.chat.completions.create(
            model="sql-lora", messages=MESSAGES, max_tokens=3, timeout=10
        )
        assert answer.model == "sql-lora"
        assert answer.usage.completion_tokens == 3

        status, text = await _unload(http, url, "sql-lora")
        assert (status, text) == (200, "Success: LoRA adapter 'sql-lora' removed successfully.")
        assert "sql-lora" not in await _cards(http, url)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client.chat.completions.create(
                model="sql-lora", messages=MESSAGES, max_tokens=3, timeout=10
            )
    finally:
        await client.close()
    stats = await _stats(http, url)
    assert (stats["lora_loads"], stats["lora_unloads"]) == (1, 1)
    assert stats["loaded_adapters"] == ["static-lora"]


SLOW_LOAD = msgspec.structs.replace(RUNTIME, time_scale=1.0, lora_load_ms=400)


async def _while_loading(
    http: aiohttp.ClientSession, url: str, name: str, during: Callable[[], Any]
) -> tuple[int, str]:
    """Start loading `name`, run `during` once the server reports the load in progress,
    then return the load's answer."""
    load = asyncio.create_task(_load(http, url, name))
    try:

        async def loading() -> bool:
            return (await _stats(http, url))["loading_adapters"] == [name]

        await _eventually(loading)
        await during()
        return await load
    finally:
        load.cancel()


async def test_an_adapter_is_not_served_while_it_loads(http: aiohttp.ClientSession) -> None:
    async with await start_fleet(1, SLOW_LOAD) as fleet:
        url = fleet.urls[0]

        async def not_yet() -> None:
            assert "slow-lora" not in await _cards(http, url)
            assert await _chat_status(http, url, "slow-lora") == 404

        assert (await _while_loading(http, url, "slow-lora", not_yet))[0] == 200
        assert await _chat_status(http, url, "slow-lora") == 200


async def test_a_restart_fails_a_load_in_progress(http: aiohttp.ClientSession) -> None:
    async with await start_fleet(1, SLOW_LOAD) as fleet:
        url = fleet.urls[0]

        async def restart() -> None:
            async with http.post(f"{url}/sim/restart") as r:
                assert r.status == 200

        status, text = await _while_loading(http, url, "lost-lora", restart)
        assert status == 503 and "restarted" in text
        assert "lost-lora" not in await _cards(http, url)
        assert (await _load(http, url, "lost-lora"))[0] == 200


@pytest.mark.parametrize(
    ("action", "body", "status", "message"),
    [
        pytest.param("load", {"lora_name": "static-lora", "lora_path": "/a"}, 400,
                     "The lora adapter 'static-lora' has already been loaded.", id="double-load"),
        pytest.param("load", {"lora_name": MODEL, "lora_path": "/a"}, 400,
                     "has already been loaded", id="the-base-model-name"),
        pytest.param("load", {"lora_name": "x"}, 400,
                     "Both 'lora_name' and 'lora_path' must be provided.", id="no-path"),
        pytest.param("unload", {}, 400, "'lora_name' needs to be provided", id="no-name"),
        pytest.param("unload", {"lora_name": "ghost"}, 404,
                     "The lora adapter 'ghost' cannot be found.", id="unknown"),
    ],
)  # fmt: skip
async def test_refused_loads_and_unloads(
    fleet: SimFleet,
    http: aiohttp.ClientSession,
    action: str,
    body: dict[str, Any],
    status: int,
    message: str,
) -> None:
    async with http.post(f"{fleet.urls[0]}/v1/{action}_lora_adapter", json=body) as r:
        assert r.status == status
        error = (await r.json())["error"]
    assert message in error["message"]
    assert error["code"] == status
    stats = await _stats(http, fleet.urls[0])
    assert (stats["lora_loads"], stats["lora_unloads"]) == (0, 0)


async def test_max_loras_bounds_the_loaded_adapters(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    url = fleet.urls[0]
    assert (await _load(http, url, "a"))[0] == 200
    assert (await _load(http, url, "b"))[0] == 200  # with static-lora: max_loras = 3
    status, text = await _load(http, url, "c")
    assert status == 400 and "max_loras=3" in text
    assert (await _unload(http, url, "a"))[0] == 200
    assert (await _load(http, url, "c"))[0] == 200
    assert (await _stats(http, url))["loaded_adapters"] == ["static-lora", "b", "c"]


async def test_concurrent_loads_of_one_name_let_exactly_one_succeed(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    results = await asyncio.gather(*(_load(http, fleet.urls[0], "twin") for _ in range(5)))
    statuses = sorted(status for status, _ in results)
    assert statuses == [200, 400, 400, 400, 400]
    assert (await _stats(http, fleet.urls[0]))["lora_loads"] == 1


async def test_a_restart_forgets_runtime_adapters(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    url = fleet.urls[0]
    assert (await _load(http, url, "gone-lora"))[0] == 200
    async with http.post(f"{url}/sim/restart") as r:
        assert r.status == 200
    assert set(await _cards(http, url)) == {MODEL, "static-lora"}
    assert (await _stats(http, url))["lora_loads"] == 1


async def test_the_endpoints_are_absent_without_runtime_updating(
    http: aiohttp.ClientSession,
) -> None:
    params = msgspec.structs.replace(RUNTIME, runtime_lora_updating=False)
    async with await start_fleet(1, params) as fleet:
        assert (await _load(http, fleet.urls[0], "x"))[0] == 404
        assert (await _unload(http, fleet.urls[0], "static-lora"))[0] == 404
        assert await _chat_status(http, fleet.urls[0], "x") == 404


def test_static_adapters_must_fit_max_loras() -> None:
    with pytest.raises(ValueError, match="exceed max_loras 1"):
        SimParams(lora_adapters=["a", "b"], max_loras=1)
