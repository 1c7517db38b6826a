"""The vLLM simulator over real sockets on 127.0.0.1: HTTP, SSE, /metrics, ZMQ, faults."""

import asyncio
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import openai
import orjson
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from bench.sim import SimFleet, SimParams, start_fleet
from bench.sim.metrics import TTFT_BUCKETS
from bench.sim.tokenizer import render_chat, tokenize
from router.config import build
from router.control.worker import Router

pytestmark = pytest.mark.timeout(30)

MODEL = "sim-llama-70b"
FAST = SimParams(time_scale=0.01, num_gpu_blocks=1024, max_model_len=8192)
MESSAGES = [
    {"role": "system", "content": "You are a simulated assistant. " * 8},
    {"role": "user", "content": "Tell me about prefix caching."},
]
PROMPT_TOKENS = tokenize(render_chat(MESSAGES))
TIMEOUT = aiohttp.ClientTimeout(total=10)
END_OF_REPLAY = b"\xff" * 8


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with await start_fleet(2, FAST) as f:
        yield f


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        yield s


@pytest.fixture
async def zmq_ctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def _chat(http: aiohttp.ClientSession, url: str, **extra: Any) -> tuple[int, Any]:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        return r.status, await r.json()


async def _sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """Data payloads of an SSE body: decoded JSON chunks, then the literal "[DONE]"."""
    out: list[Any] = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


async def _metrics(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return {f.name: f for f in text_string_to_metric_families(await r.text())}


def _sample(families: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    for s in families[family].samples:
        if s.name == sample and labels.items() <= s.labels.items():
            return s.value
    raise KeyError(sample)


async def _eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# --- OpenAI surface ----------------------------------------------------------------------


async def test_openai_sdk_chat_reports_cached_tokens_on_repeat(fleet: SimFleet) -> None:
    client = openai.AsyncOpenAI(base_url=fleet.urls[0] + "/v1", api_key="sim", max_retries=0)
    try:
        first = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, timeout=10
        )
        second = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, timeout=10
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            timeout=10,
        )
        chunks = [c async for c in stream]
    finally:
        await client.close()
    assert first.id.startswith("chatcmpl-")
    assert first.choices[0].finish_reason == "length"
    assert first.usage.prompt_tokens == len(PROMPT_TOKENS)
    assert first.usage.completion_tokens == 4
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    expected_hit = (len(PROMPT_TOKENS) - 1) // 16 * 16
    assert second.usage.prompt_tokens_details.cached_tokens == expected_hit
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 3
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == expected_hit


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))  # unit vectors


async def test_openai_sdk_embeddings_are_derived_from_the_input(fleet: SimFleet) -> None:
    """The SDK asks for base64 by default; floats, batches, token ids and `dimensions`."""
    client = openai.AsyncOpenAI(base_url=fleet.urls[0] + "/v1", api_key="sim", max_retries=0)
    text = "Prefix caching keeps the KV of a prompt's first blocks for the next request."
    texts = [text, text + " And more.", "Unrelated words entirely, see?"]
    try:
        one = await client.embeddings.create(model=MODEL, input=text, timeout=10)
        floats = await client.embeddings.create(
            model=MODEL, input=texts, encoding_format="float", timeout=10
        )
        ids = await client.embeddings.create(model=MODEL, input=tokenize(text), timeout=10)
        short = await client.embeddings.create(model=MODEL, input=[[1, 2, 3]], dimensions=8)
    finally:
        await client.close()
    assert one.id.startswith("embd-") and one.model == MODEL
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(tokenize(text))
    (vector,) = [d.embedding for d in one.data]
    assert len(vector) == 1024 and math.isclose(_cosine(vector, vector), 1, rel_tol=1e-5)
    same, longer, other = (d.embedding for d in floats.data)
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert same == pytest.approx(vector, abs=1e-6)  # base64 is float32 of the same values
    assert _cosine(same, longer) > 0.8 > 0.2 > _cosine(same, other)
    assert floats.usage.prompt_tokens == sum(len(tokenize(t)) for t in texts)
    assert ids.data[0].embedding == vector  # token ids are the text they tokenize from
    assert short.usage.prompt_tokens == 3 and len(short.data[0].embedding) == 8


async def test_embeddings_through_the_router(fleet: SimFleet) -> None:
    """The router's embeddings route, with its default strategy, in front of the simulator."""
    backends = [{"url": url, "name": f"sim-{i}"} for i, url in enumerate(fleet.urls)]
    router = Router(build({"listen": {"host": "127.0.0.1", "port": 0}, "backends": backends}))
    await router.start()
    try:
        async with (
            openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as routed,
            openai.AsyncOpenAI(base_url=fleet.urls[0] + "/v1", api_key="x", max_retries=0) as sim,
        ):
            raw = await routed.embeddings.with_raw_response.create(
                model=MODEL, input=["one text", "another"], dimensions=16, timeout=10
            )
            direct = await sim.embeddings.create(
                model=MODEL, input=["one text", "another"], dimensions=16, timeout=10
            )
            with pytest.raises(openai.NotFoundError):
                await routed.embeddings.create(model="nope", input="x", timeout=10)
    finally:
        await router.stop()
    assert raw.headers["x-kvroute-backend"] in {"sim-0", "sim-1"}
    answer = raw.parse()
    assert [d.embedding for d in answer.data] == [d.embedding for d in direct.data]
    assert answer.usage.prompt_tokens == direct.usage.prompt_tokens > 0


async def test_a_stream_opens_with_its_first_token_as_vllm_does(
    http: aiohttp.ClientSession,
) -> None:
    # vLLM sends the role chunk with the first output, once the prompt is prefilled: a
    # router that takes the first chunk for the end of the prefill must not be misled
    async with await start_fleet(1, msgspec.structs.replace(FAST, time_scale=1.0)) as fleet:
        stats = fleet.backends[0].stats
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True}
        async with http.post(f"{fleet.urls[0]}/v1/chat/completions", json=body) as r:
            first = await r.content.readline()
            sampled_by_then = stats.generation_tokens
            rest = await _sse(r)
    assert orjson.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
    assert sampled_by_then >= 1
    assert rest[-1] == "[DONE]"


async def test_completions_stream_framing(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    body = {"prompt": "a" * 100, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{fleet.urls[1]}/v1/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    chunks = [
        orjson.loads(part[6:]) for part in raw.split(b"\n\n") if part[6:] not in (b"", b"[DONE]")
    ]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert chunks[0]["id"].startswith("cmpl-")
    tokens = [c for c in chunks if c["choices"]]
    assert len(tokens) == 16  # default_max_tokens, ended as if by EOS
    assert tokens[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["prompt_tokens"] == 25


async def test_completions_token_id_prompt_and_non_stream(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": list(range(40)), "max_tokens": 2}
    async with http.post(f"{fleet.urls[0]}/v1/completions", json=body) as r:
        data = await r.json()
    assert data["object"] == "text_completion"
    assert data["usage"]["prompt_tokens"] == 40
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert data["choices"][0]["text"] == "The quic"


async def test_cache_salt_isolates_and_request_id_is_echoed(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    url = fleet.urls[0]
    await _chat(http, url)
    _, salted = await _chat(http, url, cache_salt="tenant-a")
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "cache_salt": "tenant-a"}
    async with http.post(
        f"{url}/v1/chat/completions", json=body, headers={"X-Request-Id": "req-42"}
    ) as r:
        again = await r.json()
        assert r.headers["X-Request-Id"] == "req-42"
    assert again["id"] == "chatcmpl-req-42"
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize(
    ("path", "body", "status", "error_type", "param"),
    [
        pytest.param("/v1/chat/completions", {"model": "nope", "messages": []}, 404,
                     "NotFoundError", "model", id="unknown-model"),
        pytest.param("/v1/completions", b"{not json", 400, "BadRequestError", None,
                     id="malformed-json"),
        pytest.param("/v1/completions", {"prompt": "x", "stream_options": {}}, 400,
                     "BadRequestError", None, id="stream-options-without-stream"),
        pytest.param("/v1/completions", {"prompt": "x", "cache_salt": "a@b"}, 400,
                     "BadRequestError", None, id="bad-salt"),
        pytest.param("/v1/completions", {"prompt": "x", "max_tokens": 9000}, 400,
                     "BadRequestError", None, id="too-long"),
        pytest.param("/v1/completions", {"prompt": ""}, 400, "BadRequestError", "prompt",
                     id="empty-prompt"),
        pytest.param("/v1/embeddings", {"model": "nope", "input": "x"}, 404, "NotFoundError",
                     "model", id="embeddings-unknown-model"),
        pytest.param("/v1/embeddings", {"model": MODEL}, 400, "BadRequestError", None,
                     id="embeddings-no-input"),
        *(
            pytest.param("/v1/embeddings", {"input": value}, 400, "BadRequestError", "input",
                         id=f"embeddings-input-{name}")
            for name, value in [("empty", ""), ("none", []), ("empty-ids", [[]]),
                                ("mixed", ["x", 1]), ("vocab", [32000]),
                                ("too-long", "word" * 8193)]
        ),
        pytest.param("/v1/embeddings", {"input": "x", "dimensions": 1025}, 400,
                     "BadRequestError", "dimensions", id="embeddings-too-many-dimensions"),
        pytest.param("/v1/embeddings", {"input": "x", "dimensions": 0}, 400, "BadRequestError",
                     None, id="embeddings-no-dimensions"),
    ],
)  # fmt: skip
async def test_errors_have_vllm_shape(
    fleet: SimFleet,
    http: aiohttp.ClientSession,
    path: str,
    body: Any,
    status: int,
    error_type: str,
    param: str | None,
) -> None:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with http.post(fleet.urls[0] + path, data=data) as r:
        assert r.status == status
        error = (await r.json())["error"]
    assert (error["type"], error["param"], error["code"]) == (error_type, param, status)
    assert error["message"]


async def test_lora_adapter_is_served_and_isolated(http: aiohttp.ClientSession) -> None:
    params = msgspec.structs.replace(FAST, lora_adapters=["sql-lora"])
    async with await start_fleet(1, params) as fleet:
        url = fleet.urls[0]
        async with http.get(f"{url}/v1/models") as r:
            cards = (await r.json())["data"]
        await _chat(http, url)
        _, lora = await _chat(http, url, model="sql-lora")
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL, None), ("sql-lora", MODEL)]
    assert cards[0]["object"] == "model" and cards[0]["max_model_len"] == 8192
    assert lora["model"] == "sql-lora"
    assert lora["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_tokenize_matches_the_documented_tokenizer(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    url = fleet.urls[0]
    async with http.post(f"{url}/tokenize", json={"messages": MESSAGES}) as r:
        chat = await r.json()
    async with http.post(f"{url}/tokenize", json={"prompt": "hello world"}) as r:
        plain = await r.json()
    assert chat == {"count": len(PROMPT_TOKENS), "max_model_len": 8192, "tokens": PROMPT_TOKENS,
                    "token_strs": None}  # fmt: skip
    assert plain["tokens"] == tokenize("hello world")


async def test_health_load_version(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    async with http.get(f"{url}/health") as r:
        assert (r.status, await r.read()) == (200, b"")
    async with http.get(f"{url}/load") as r:
        assert await r.json() == {"server_load": 0}
    async with http.get(f"{url}/version") as r:
        assert "version" in await r.json()
    async with http.get(f"{url}/kv_event_sources") as r:
        assert await r.json() == {}


# --- metrics -----------------------------------------------------------------------------


async def test_metrics_use_vllm_names_types_and_labels(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    url = fleet.urls[0]
    await _chat(http, url)
    await _chat(http, url)
    families = await _metrics(http, url)
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:request_success": "counter",
        "vllm:cache_config_info": "gauge",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
    }
    assert {name: families[name].type for name in expected} == expected
    labels = {"model_name": MODEL, "engine": "0"}
    queries = _sample(families, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
    hits = _sample(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total", **labels)
    assert (queries, hits) == (2 * len(PROMPT_TOKENS), (len(PROMPT_TOKENS) - 1) // 16 * 16)
    success = "vllm:request_success_total"
    assert _sample(families, "vllm:request_success", success, finished_reason="length") == 2
    assert _sample(families, "vllm:generation_tokens", "vllm:generation_tokens_total") == 8
    info = families["vllm:cache_config_info"].samples[0]
    assert info.value == 1
    assert {k: info.labels[k] for k in ("block_size", "num_gpu_blocks", "engine")} == {
        "block_size": "16",
        "num_gpu_blocks": "1024",
        "engine": "0",
    }
    assert "enable_prefix_caching" in info.labels and "prefix_caching_hash_algo" in info.labels
    buckets = [
        float(s.labels["le"])
        for s in families["vllm:time_to_first_token_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
    ]
    assert buckets == list(TTFT_BUCKETS)
    ttft_count = "vllm:time_to_first_token_seconds_count"
    assert _sample(families, "vllm:time_to_first_token_seconds", ttft_count, **labels) == 2


# --- KV events ---------------------------------------------------------------------------


def _event_fields(event: Any) -> tuple[str, dict[str, Any]]:
    """Tag and fields of an event in either encoding, the way a router must read it."""
    if isinstance(event, dict):
        return event["type"], event
    names = {
        "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                        "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                        "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
        "BlockRemoved": ("block_hashes", "medium", "group_idx"),
        "AllBlocksCleared": (),
    }[event[0]]  # fmt: skip
    assert len(event) == len(names) + 1
    return event[0], dict(zip(names, event[1:], strict=True))


async def _replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
            if frames[2] == END_OF_REPLAY:
                assert frames == [b"", b"", END_OF_REPLAY, b""]
                return replies
            replies.append(frames)
    finally:
        dealer.close(linger=0)


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_kv_events_publish_and_replay(
    encoding: str, http: aiohttp.ClientSession, zmq_ctx: zmq.asyncio.Context
) -> None:
    params = msgspec.structs.replace(
        FAST,
        kv_events=True,
        kv_events_encoding=encoding,
        kv_events_topic="kv@{host}:{port}@{model}",
    )
    async with await start_fleet(1, params) as fleet:
        backend = fleet.backends[0]
        topic = f"kv@127.0.0.1:{backend.port}@{MODEL}".encode()
        async with http.get(f"{backend.url}/kv_event_sources") as r:
            sources = await r.json()
        assert sources["0"]["endpoint"] == backend.publisher.endpoint
        sub = zmq_ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(backend.publisher.endpoint)
        await asyncio.sleep(0.3)  # let the subscription reach the PUB (slow joiner)
        await _chat(http, backend.url, cache_salt="tenant")
        frames = await asyncio.wait_for(sub.recv_multipart(), 5)
        assert frames[:2] == [topic, (0).to_bytes(8, "big")]
        ts, events, rank = msgspec.msgpack.decode(frames[2])
        assert isinstance(ts, float) and rank == 0
        tag, stored = _event_fields(events[0])
        assert tag == "BlockStored"
        n = len(stored["block_hashes"])
        assert n == len(PROMPT_TOKENS) // 16
        assert stored["token_ids"] == PROMPT_TOKENS[: n * 16]
        assert stored["parent_block_hash"] is None
        assert (stored["block_size"], stored["medium"]) == (16, "GPU")
        assert stored["extra_keys"][0] == ["tenant"]
        assert all(0 <= h < 2**64 for h in stored["block_hashes"])
        if encoding == "map":
            assert "group_idx" not in events[0]  # None defaults are omitted
        assert await backend.engine.reset_prefix_cache()
        replies = await _replay(zmq_ctx, backend.publisher.replay_endpoint, 0)
        assert replies[0][:3] == [b"", topic, (0).to_bytes(8, "big")]
        assert replies[0][3] == frames[2]
        last_tag, _ = _event_fields(msgspec.msgpack.decode(replies[-1][3])[1][-1])
        assert last_tag == "AllBlocksCleared"
        later = await _replay(zmq_ctx, backend.publisher.replay_endpoint, len(replies) - 1)
        assert later == replies[-1:]
        sub.close(linger=0)


async def test_restart_resets_cache_seq_and_metrics(
    http: aiohttp.ClientSession, zmq_ctx: zmq.asyncio.Context
) -> None:
    async with await start_fleet(1, msgspec.structs.replace(FAST, kv_events=True)) as fleet:
        backend = fleet.backends[0]
        await _chat(http, backend.url)
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5000, "stream": True}
        async with http.post(f"{backend.url}/v1/chat/completions", json=body) as stream:
            await stream.content.readline()
            async with http.post(f"{backend.url}/sim/restart") as r:
                assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await stream.read()  # a restart drops in-flight requests
        _, again = await _chat(http, backend.url)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        families = await _metrics(http, backend.url)
        assert _sample(families, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == len(
            PROMPT_TOKENS
        )
        replies = await _replay(zmq_ctx, backend.publisher.replay_endpoint, 0)
        assert [int.from_bytes(r[2], "big") for r in replies] == [0]
        assert backend.stats.requests_finished == 2  # the simulator's totals survive


# --- faults and cancellation -------------------------------------------------------------


async def _set_fault(http: aiohttp.ClientSession, url: str, **fault: Any) -> None:
    async with http.post(f"{url}/sim/fault", json=fault) as r:
        assert r.status == 200


async def test_fault_fail(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    await _set_fault(http, url, mode="fail", status=503)
    status, body = await _chat(http, url)
    assert status == 503
    assert body["error"]["type"] == "ServiceUnavailableError"
    async with http.get(f"{url}/health") as r:
        assert r.status == 503
    async with http.get(f"{fleet.urls[1]}/health") as r:
        assert r.status == 200
    await _set_fault(http, url, mode="none")
    assert (await _chat(http, url))[0] == 200


async def test_fault_hang_until_client_timeout_or_restart(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    url = fleet.urls[0]
    fleet.backends[0].set_fault(msgspec.convert({"mode": "hang"}, type(fleet.backends[0].fault)))
    with pytest.raises(asyncio.TimeoutError):
        async with http.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=0.3)):
            pass
    pending = asyncio.create_task(_chat(http, url))
    await asyncio.sleep(0.1)
    assert not pending.done()
    async with http.post(f"{url}/sim/restart") as r:
        assert r.status == 200
    with pytest.raises(aiohttp.ClientError):
        await pending  # a restart drops the connection
    async with http.get(f"{url}/health") as r:
        assert r.status == 200  # and clears the fault


async def test_fault_close_midstream(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    await _set_fault(http, url, mode="close_midstream", after_chunks=2)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "stream": True}
    received: list[bytes] = []
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: "):
                    received.append(line)
    assert len(received) == 2
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await _chat(http, url)
    await _eventually(lambda: fleet.backends[0].engine.num_running == 0)


async def test_wall_clock_follows_the_step_model(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    # 1 prefill step + 199 decode steps of (25 + 0.15) ms x 0.01: sub-millisecond steps,
    # finer than uvloop's 1 ms timers, must still add up.
    start = time.perf_counter()
    assert (await _chat(http, fleet.urls[0], max_tokens=200))[0] == 200
    elapsed = time.perf_counter() - start
    assert 0.05 <= elapsed < 1.0
    assert fleet.backends[0].stats.busy_seconds == pytest.approx(0.05, rel=0.05)


async def test_fault_slow(http: aiohttp.ClientSession) -> None:
    params = msgspec.structs.replace(FAST, time_scale=0.02)
    async with await start_fleet(1, params) as fleet:
        url, stats = fleet.urls[0], fleet.backends[0].stats
        assert (await _chat(http, url, max_tokens=20))[0] == 200
        normal = stats.busy_seconds
        await _set_fault(http, url, mode="slow", factor=10)
        start = time.perf_counter()
        assert (await _chat(http, url, max_tokens=20))[0] == 200
        wall = time.perf_counter() - start
        slow = stats.busy_seconds - normal
    # unscaled, both requests cost about the same (the second hits the prefix cache)
    assert slow > 5 * normal
    assert wall >= 0.9 * slow


async def test_client_disconnect_aborts_the_request(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    backend = fleet.backends[0]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5000, "stream": True}
    async with http.post(f"{backend.url}/v1/chat/completions", json=body) as r:
        await r.content.readline()
        assert backend.engine.num_running + backend.engine.num_waiting == 1
        r.close()
    await _eventually(lambda: backend.stats.requests_aborted == 1)
    body["stream"] = False
    with pytest.raises(asyncio.TimeoutError):
        url = f"{backend.url}/v1/chat/completions"
        async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=0.2)):
            pass
    await _eventually(lambda: backend.stats.requests_aborted == 2)
    assert backend.engine.num_running == backend.engine.num_waiting == 0
    assert backend.engine.kv.usage == 0.0
    families = await _metrics(http, backend.url)
    assert _sample(families, "vllm:request_success", "vllm:request_success_total",
                   finished_reason="abort") == 2  # fmt: skip


# --- entry points ------------------------------------------------------------------------


async def test_cli_speeds_make_a_half_speed_instance_prefill_twice_as_long(
    http: aiohttp.ClientSession,
) -> None:
    """`kvroute sim --speeds 1,0.5`: the same prompt, asked of each instance, costs the
    half-speed one twice the simulated prefill time, by the simulator's own account, and
    /sim/stats reports each one's true speeds."""
    root = Path(__file__).resolve().parents[2]
    argv = ["--instances", "2", "--time-scale", "0.01", "--speeds", "1,0.5"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.sim", *argv,
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        urls = [(await asyncio.wait_for(proc.stdout.readline(), 10)).decode().strip()]
        urls.append((await asyncio.wait_for(proc.stdout.readline(), 10)).decode().strip())
        stats = []
        for url in urls:
            assert (await _chat(http, url, max_tokens=1))[0] == 200
            async with http.get(f"{url}/sim/stats") as r:
                stats.append(await r.json())
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 10)
    fast, slow = stats
    assert fast["prompt_tokens"] == slow["prompt_tokens"] == len(PROMPT_TOKENS)
    assert fast["prefill_sim_ms"] > 0
    assert slow["prefill_sim_ms"] == pytest.approx(2 * fast["prefill_sim_ms"])
    assert fast["true_speeds"] == {
        "speed": 1.0,
        "prefill_tokens_per_s": pytest.approx(10_000),
        "decode_step_base_ms": 25.0,
        "decode_per_seq_ms": 0.15,
        "time_scale": 0.01,
    }
    assert slow["true_speeds"]["prefill_tokens_per_s"] == pytest.approx(5_000)
    assert slow["true_speeds"]["decode_step_base_ms"] == 50.0


async def test_cli_prints_urls_and_stops_on_sigterm(http: aiohttp.ClientSession) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    argv = [
        "--instances",
        "2",
        "--time-scale",
        "0.01",
        "--kv-events",
        "--kv-events-encoding",
        "array",
    ]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.sim", *argv,
        cwd=root, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [(await asyncio.wait_for(proc.stdout.readline(), 10)).decode() for _ in range(4)]
        urls = [line.strip() for line in lines[:2]]
        assert all(u.startswith("http://127.0.0.1:") for u in urls)
        assert lines[2].startswith(f"kv-events {urls[0]} pub=tcp://127.0.0.1:")
        for url in urls:
            assert (await _chat(http, url))[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
