"""The simulator's CPU offload tier: a victim cache of GPU evictions, its events, its loads."""

from __future__ import annotations

from bench.sim.kv_cache import KVCache
from bench.sim.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored
from bench.sim.params import SimParams
from bench.sim.request import SimRequest
from bench.sim.scheduler import Scheduler

BS = 16


def _req(tokens: range, rid: str = "r") -> SimRequest:
    return SimRequest(
        rid, list(tokens), max_tokens=1, limit_reason="length", block_size=BS, model="m"
    )


def _fill(kv: KVCache, req: SimRequest) -> None:
    """Admit the whole prompt (its GPU hit, then the rest) and free it."""
    hit = kv.computed_blocks(req)
    assert kv.allocate(req, req.num_tokens - len(hit) * BS, hit)
    kv.free(req)


def _shape(event) -> tuple:
    if isinstance(event, BlockStored):
        return ("stored", event.medium, tuple(event.block_hashes), len(event.token_ids))
    return ("removed", event.medium, tuple(event.block_hashes))


def test_an_eviction_is_offloaded_and_announced_before_the_gpu_removal() -> None:
    kv = KVCache(5, BS, True, cpu_blocks=8)  # 4 usable GPU blocks
    a = _req(range(32), "a")
    _fill(kv, a)
    kv.take_events()
    _fill(kv, _req(range(1000, 1048), "b"))  # 3 blocks: evicts a's tail block
    shapes = [_shape(e) for e in kv.take_events() if _shape(e)[:2] != ("stored", MEDIUM_GPU)]
    assert shapes == [
        ("stored", MEDIUM_CPU, (a.block_hashes[1],), 0),
        ("removed", MEDIUM_GPU, (a.block_hashes[1],)),
    ]
    assert kv.num_cpu_cached == 1


def test_the_placeholder_has_vllms_offloading_shape() -> None:
    kv = KVCache(3, BS, True, cpu_blocks=8)  # 2 usable blocks
    _fill(kv, _req(range(32), "a"))
    kv.take_events()
    _fill(kv, _req(range(500, 532), "b"))
    stored = [e for e in kv.take_events() if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert stored and all(
        (e.token_ids, e.block_size, e.parent_block_hash) == ([], 0, None) for e in stored
    )


def test_the_cpu_lru_evicts_its_oldest_with_a_cpu_removal() -> None:
    kv = KVCache(3, BS, True, cpu_blocks=2)
    first = _req(range(32), "first")
    _fill(kv, first)
    for i in range(1, 4):  # each two-block prompt pushes the last one to the CPU
        _fill(kv, _req(range(1000 * i, 1000 * i + 32), f"r{i}"))
    removed = [e for e in kv.take_events() if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert [h for e in removed for h in e.block_hashes][:2] == first.block_hashes[::-1]
    assert kv.num_cpu_cached == 2


def test_a_lookup_continues_from_the_gpu_run_into_the_cpu() -> None:
    kv = KVCache(5, BS, True, cpu_blocks=8)
    a = _req(range(48), "a")  # 3 blocks
    _fill(kv, a)
    _fill(kv, _req(range(1000, 1048), "b"))  # 3 blocks: one free, then a's two tail blocks
    again = _req(range(48 + 1), "again")
    gpu = kv.computed_blocks(again)
    assert len(gpu) == 1
    assert kv.offloaded(again, len(gpu)) == 2
    assert kv.offloaded(_req(range(48), "capped"), 1) == 1  # the last block is recomputed


def test_a_reset_clears_the_cpu_tier() -> None:
    kv = KVCache(3, BS, True, cpu_blocks=8)
    _fill(kv, _req(range(32), "a"))
    _fill(kv, _req(range(500, 532), "b"))
    assert kv.num_cpu_cached and kv.reset_prefix_cache()
    assert kv.num_cpu_cached == 0


def test_a_cpu_hit_is_loaded_at_the_load_cost_not_prefilled() -> None:
    params = SimParams(num_gpu_blocks=40, num_cpu_blocks=100, max_model_len=600)
    kv = KVCache(params.num_gpu_blocks, BS, True, params.num_cpu_blocks)
    scheduler = Scheduler(params, kv)
    doc = range(320)  # 20 blocks
    _fill(kv, _req(doc, "doc"))
    _fill(kv, _req(range(5000, 5000 + 480), "other"))  # 30 blocks: the doc goes to the CPU
    again = _req(range(320 + 8), "again")
    scheduler.add(again)
    plan = scheduler.schedule()
    assert plan.loaded_tokens == again.num_loaded_tokens > 0
    assert again.num_cached_tokens >= again.num_loaded_tokens  # what usage reports as cached
    assert plan.prefill_tokens == again.num_tokens - again.num_cached_tokens
    cost = scheduler.step_ms(plan)
    prefill_all = params.step_base_ms + params.prefill_per_token_ms * again.num_tokens
    assert params.step_base_ms < cost < prefill_all / 2
