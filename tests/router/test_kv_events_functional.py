"""KV events from the simulator (real ZMQ, both encodings) keep the prefix index exact."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import zmq.asyncio

from bench.sim.fleet import start_fleet
from bench.sim.params import SimParams
from hashing.canonical import Message
from hashing.chat_tokens import PromptBlocks
from hashing.tiered_index import TieredIndex
from router.telemetry.kv_events import EventApplier, EventSubscriber

MODEL = "sim-llama-70b"
DOC = "".join(f"clause {i}: the tenant shall keep the premises in good order. " for i in range(60))


def sim_params(encoding: str) -> SimParams:
    return SimParams(
        kv_events=True, kv_events_encoding=encoding, time_scale=0.01, num_gpu_blocks=4000
    )


async def chat(url: str, question: str, salt: str | None = None) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": question}],
        "max_tokens": 2,
    }
    if salt:
        body["cache_salt"] = salt
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            return await resp.json()


def keys_of(question: str, salt: str | None = None) -> list[int]:
    messages = [Message("system", DOC), Message("user", question)]
    return PromptBlocks(16, 4096).chat(MODEL, salt, messages)[0]


async def until(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_index_follows_stores_evictions_and_restarts(encoding: str) -> None:
    fleet = await start_fleet(1, sim_params(encoding))
    ctx = zmq.asyncio.Context()
    index = TieredIndex()
    resets: list[str] = []
    backend = fleet.backends[0]
    applier = EventApplier("b0", index, 16, lambda: MODEL)
    pub = backend.publisher
    sub = EventSubscriber(ctx, applier, pub.endpoint, pub.replay_endpoint, "", resets.append)
    task = asyncio.create_task(sub.run())
    try:
        await asyncio.sleep(0.2)  # the SUB connects (a PUB drops what no one receives)
        await chat(backend.url, "who repairs the roof?")
        keys = keys_of("who repairs the roof?")
        await until(lambda: index.gpu.longest_prefix(keys, "b0") > 0)
        # the prompt's full blocks are all held; a salted twin is not
        assert index.gpu.longest_prefix(keys, "b0") == len(keys)
        assert index.gpu.longest_prefix(keys_of("who repairs the roof?", salt="t1"), "b0") == 0
        # a second request shares the document's blocks, and the backend reports the hit
        reply = await chat(backend.url, "and the windows?")
        other = keys_of("and the windows?")
        shared = sum(a == b for a, b in zip(keys, other, strict=False))
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == shared * 16
        assert index.gpu.longest_prefix(other, "b0") >= shared
        # a restart resets the sequence: the index forgets the backend
        backend.restart()
        await chat(backend.url, "a fresh start")
        await until(lambda: bool(resets))
        assert "restarted" in resets[0]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await fleet.stop()
        ctx.term()


async def test_gap_is_filled_by_replay() -> None:
    fleet = await start_fleet(1, sim_params("map"))
    ctx = zmq.asyncio.Context()
    index = TieredIndex()
    backend = fleet.backends[0]
    applier = EventApplier("b0", index, 16, lambda: MODEL)
    pub = backend.publisher
    sub = EventSubscriber(ctx, applier, pub.endpoint, pub.replay_endpoint, "", pytest.fail)
    try:
        # batches published while nobody listens are lost on the PUB socket...
        await chat(backend.url, "first question")
        sub.last_seq = -1  # ...as if we had seen nothing before seq 0
        task = asyncio.create_task(sub.run())
        await asyncio.sleep(0.2)
        await chat(backend.url, "second question")
        await until(lambda: applier.stats.gaps_replayed == 1)
        assert index.gpu.longest_prefix(keys_of("first question"), "b0") == len(
            keys_of("first question")
        )
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await fleet.stop()
        ctx.term()


class _Failing(EventApplier):
    def apply_payloads(self, payloads) -> None:
        raise RuntimeError("the index refused a batch")


async def test_a_batch_that_fails_ends_the_subscription_with_its_error_and_keeps_its_place() -> (
    None
):
    """The reads run in the socket's callback: a failure there reaches `run` (whose
    caller subscribes again), and the sequence stays before the batch, so it is read
    again rather than lost."""
    fleet = await start_fleet(1, sim_params("map"))
    ctx = zmq.asyncio.Context()
    backend = fleet.backends[0]
    pub = backend.publisher
    applier = _Failing("b0", TieredIndex(), 16, lambda: MODEL)
    sub = EventSubscriber(ctx, applier, pub.endpoint, pub.replay_endpoint, "", pytest.fail)
    task = asyncio.create_task(sub.run())
    try:
        for turn in range(100):  # until the SUB has connected and a batch came
            await chat(backend.url, f"question {turn}")
            done, _ = await asyncio.wait([task], timeout=0.1)
            if done:
                break
        assert task.done()
        with pytest.raises(RuntimeError, match="refused"):
            await task
        assert sub.last_seq is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await fleet.stop()
        ctx.term()
