"""Prefill/decode disaggregation on the simulator, driven as vLLM's toy P/D proxy does:
a prefill call with do_remote_decode, then the original request to a decode instance
with the kv_transfer_params the prefill answered."""

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.sim import SimFleet, SimParams, start_fleet
from bench.sim.cli import build_parser
from bench.sim.kv_cache import KVCache
from bench.sim.kv_events import BlockStored
from bench.sim.params import load_config, scaled_seconds
from bench.sim.request import SimRequest
from bench.sim.scheduler import Scheduler
from bench.sim.tokenizer import render_chat, tokenize

pytestmark = pytest.mark.timeout(30)

MODEL = "sim-llama-70b"
FAST = SimParams(time_scale=0.01, num_gpu_blocks=1024, max_model_len=8192)
ROLES = ["prefill", "decode", "both"]
PREFILL, DECODE, BOTH = range(3)
MESSAGES = [
    {"role": "system", "content": "You are a disaggregated assistant. " * 12},
    {"role": "user", "content": "Where was my prompt prefilled?"},
]
PROMPT_LEN = len(tokenize(render_chat(MESSAGES)))
TIMEOUT = aiohttp.ClientTimeout(total=10)
DO_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with await start_fleet(3, FAST, roles=ROLES) as f:
        yield f


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        yield s


async def _post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], path: str = "chat/completions"
) -> tuple[int, Any]:
    async with http.post(f"{url}/v1/{path}", json=body) as r:
        return r.status, await r.json()


async def _prefill(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    """The proxy's first step: one token on the prefill instance, for a remote decode."""
    remote = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": DO_REMOTE_DECODE}
    remote.pop("stream_options", None)
    status, answer = await _post(http, url, remote)
    assert status == 200, answer
    return answer


async def _stats(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/sim/stats") as r:
        return await r.json()


async def _counter(http: aiohttp.ClientSession, url: str, family: str) -> float:
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    (f,) = (f for f in text_string_to_metric_families(text) if f.name == family)
    return sum(s.value for s in f.samples if s.name.endswith("_total"))


async def test_prefill_then_decode_without_streaming(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5}
    prefill = await _prefill(http, fleet.urls[PREFILL], body)
    params = prefill["kv_transfer_params"]
    producer = fleet.backends[PREFILL]
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": params["remote_block_ids"],
        "remote_engine_id": producer.engine_id,
        "remote_request_id": prefill["id"].removeprefix("chatcmpl-"),
        "remote_host": producer.host,
        "remote_port": producer.port,
        "tp_size": 1,
    }
    assert len(params["remote_block_ids"]) == PROMPT_LEN // 16
    assert prefill["usage"]["completion_tokens"] == 1

    status, answer = await _post(http, fleet.urls[DECODE], {**body, "kv_transfer_params": params})
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == PROMPT_LEN
    assert answer["usage"]["completion_tokens"] == 5
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == PROMPT_LEN - 1
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["kv_transfer_params"] is None

    decode = fleet.backends[DECODE].stats
    assert decode.kv_transfer_tokens == PROMPT_LEN - 1
    assert decode.prefix_cache_hits == 0  # transferred, not a local prefix hit
    hits = await _counter(http, fleet.urls[DECODE], "vllm:external_prefix_cache_hits")
    assert hits == PROMPT_LEN - 1


async def test_decode_streams_through_the_openai_sdk(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": True}
    prefill = await _prefill(
        http, fleet.urls[PREFILL], {**body, "stream_options": {"include_usage": True}}
    )
    client = openai.AsyncOpenAI(base_url=fleet.urls[DECODE] + "/v1", api_key="sim", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"kv_transfer_params": prefill["kv_transfer_params"]},
            timeout=10,
        )
        chunks = [c async for c in stream]
    finally:
        await client.close()
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(tokenize("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)))
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == PROMPT_LEN
    assert chunks[-1].usage.completion_tokens == 4
    stats = await _stats(http, fleet.urls[DECODE])
    assert (stats["kv_role"], stats["decodes_from_remote_prefill"]) == ("decode", 1)
    assert stats["kv_transfer_tokens"] == PROMPT_LEN - 1
    stats = await _stats(http, fleet.urls[PREFILL])
    assert (stats["kv_role"], stats["prefills_for_remote_decode"]) == ("prefill", 1)


async def test_transferred_blocks_join_the_decode_prefix_cache(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    prefill = await _prefill(http, fleet.urls[PREFILL], body)
    url = fleet.urls[DECODE]
    await _post(http, url, {**body, "kv_transfer_params": prefill["kv_transfer_params"]})
    status, plain = await _post(http, url, body)  # no transfer: a local prefix-cache hit
    assert status == 200
    expected_hit = (PROMPT_LEN - 1) // 16 * 16
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_hit
    assert fleet.backends[DECODE].stats.prefix_cache_hits == expected_hit


def test_the_transferred_prompt_is_committed_and_charged_transfer_not_prefill() -> None:
    params = msgspec.structs.replace(FAST, kv_role="decode")
    kv = KVCache(params.num_gpu_blocks, 16, True)
    scheduler = Scheduler(params, kv)
    req = SimRequest(
        "d",
        list(range(1000)),
        max_tokens=2,
        limit_reason="length",
        block_size=16,
        model=MODEL,
        remote_prefill=True,
    )
    scheduler.add(req)
    plan = scheduler.schedule()
    assert (plan.transferred_tokens, plan.prefill_tokens) == (999, 1)
    assert scheduler.step_ms(plan) == pytest.approx(
        params.step_base_ms + params.prefill_per_token_ms + 999 * params.kv_transfer_per_token_ms
    )
    stored = [h for e in kv.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == req.block_hashes[: 1000 // 16]


async def test_decode_ttft_is_transfer_plus_one_step_not_the_prefill(
    http: aiohttp.ClientSession,
) -> None:
    params = msgspec.structs.replace(FAST, time_scale=1.0)
    prompt = "long document " * 1200  # 4200 tokens: a 445 ms prefill, a 33 ms decode TTFT
    n = len(tokenize(prompt))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    async with await start_fleet(3, params, roles=ROLES) as fleet:
        status, _ = await _post(http, fleet.urls[BOTH], body, "completions")
        assert status == 200
        remote = {**body, "kv_transfer_params": DO_REMOTE_DECODE}
        status, prefill = await _post(http, fleet.urls[PREFILL], remote, "completions")
        assert status == 200
        decode_body = {**body, "kv_transfer_params": prefill["kv_transfer_params"]}
        status, _ = await _post(http, fleet.urls[DECODE], decode_body, "completions")
        assert status == 200
        combined, decode = fleet.backends[BOTH], fleet.backends[DECODE]
        # simulated step accounting: one step each, exactly the cost model's
        prefill_ms = params.step_base_ms + params.prefill_per_token_ms * n
        transfer_ms = (
            params.step_base_ms
            + params.prefill_per_token_ms
            + params.kv_transfer_per_token_ms * (n - 1)
        )
        assert combined.stats.busy_seconds == pytest.approx(scaled_seconds(params, prefill_ms))
        assert decode.stats.busy_seconds == pytest.approx(scaled_seconds(params, transfer_ms))
        # and what a client sees, with a margin far above timer jitter
        ttft = "vllm:time_to_first_token_seconds"
        combined_ttft = await _histogram_sum(http, combined.url, ttft)
        decode_ttft = await _histogram_sum(http, decode.url, ttft)
        assert decode_ttft < combined_ttft / 3


async def _histogram_sum(http: aiohttp.ClientSession, url: str, family: str) -> float:
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    (f,) = (f for f in text_string_to_metric_families(text) if f.name == family)
    (total,) = (s.value for s in f.samples if s.name == family + "_sum")
    return total


@pytest.mark.parametrize(
    ("target", "transfer", "needle"),
    [
        pytest.param(PREFILL, {"do_remote_prefill": True, "remote_engine_id": "e"},
                     "kv_producer", id="remote-prefill-to-a-prefill-instance"),
        pytest.param(DECODE, {"do_remote_decode": True}, "kv_consumer",
                     id="remote-decode-to-a-decode-instance"),
        pytest.param(BOTH, "yes", "kv_transfer_params", id="not-an-object"),
        pytest.param(BOTH, {"do_remote_prefill": True}, "remote_engine_id",
                     id="no-remote-engine-id"),
        pytest.param(BOTH, {"do_remote_prefill": True, "do_remote_decode": True,
                            "remote_engine_id": "e"}, "both", id="both-directions"),
    ],
)  # fmt: skip
async def test_a_wrong_role_or_malformed_transfer_is_a_400(
    fleet: SimFleet, http: aiohttp.ClientSession, target: int, transfer: Any, needle: str
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "kv_transfer_params": transfer}
    status, answer = await _post(http, fleet.urls[target], body)
    assert status == 400
    assert answer["error"]["type"] == "BadRequestError"
    assert answer["error"]["code"] == 400
    assert needle in answer["error"]["message"]
    assert fleet.backends[target].stats.requests_received == 0


async def test_plain_requests_are_served_on_any_role_and_counted_off_both(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3}
    for url in fleet.urls:
        status, answer = await _post(http, url, body)
        assert status == 200
        assert answer["usage"]["completion_tokens"] == 3
    counts = [(await _stats(http, url))["plain_requests_on_pd_role"] for url in fleet.urls]
    assert counts == [1, 1, 0]


async def test_a_both_instance_produces_and_consumes(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    prefill = await _prefill(http, fleet.urls[BOTH], body)
    assert prefill["kv_transfer_params"]["remote_engine_id"] == fleet.backends[BOTH].engine_id
    decode_body = {**body, "kv_transfer_params": prefill["kv_transfer_params"]}
    status, answer = await _post(http, fleet.urls[BOTH], decode_body)
    assert status == 200
    assert answer["usage"]["completion_tokens"] == 2


async def test_roles_must_match_the_fleet_size() -> None:
    with pytest.raises(ValueError, match="2 roles for 3 backends"):
        await start_fleet(3, FAST, roles=["prefill", "decode"])


def test_the_cli_takes_one_role_per_instance() -> None:
    args = build_parser().parse_args(
        ["--instances", "3", "--roles", "prefill", "prefill", "decode"]
    )
    assert args.roles == ["prefill", "prefill", "decode"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--roles", "producer"])
    assert load_config(None, {"instances": 2, "roles": ["prefill", "decode"]}).roles == [
        "prefill",
        "decode",
    ]
    with pytest.raises(ValueError, match="3 roles for 2 instances"):
        load_config(None, {"instances": 2, "roles": ["prefill", "decode", "decode"]})
