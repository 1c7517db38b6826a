"""Pure tests of the vLLM simulator: tokenizer, prefix cache, scheduler, events, config."""

import re
import subprocess
import sys
from typing import Any

import msgspec
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.sim import cli
from bench.sim.kv_cache import KVCache
from bench.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from bench.sim.params import Fault, SimConfig, SimParams, load_config
from bench.sim.request import SimRequest, Status, output_text
from bench.sim.scheduler import Scheduler
from bench.sim.tokenizer import render_chat, token_strs, tokenize

BS = 16


def _req(
    tokens: list[int] | range,
    *,
    rid: str = "r",
    max_tokens: int = 4,
    model: str = "m",
    salt: str | None = None,
    lora_id: int | None = None,
) -> SimRequest:
    return SimRequest(
        rid,
        list(tokens),
        max_tokens=max_tokens,
        limit_reason="length",
        block_size=BS,
        model=model,
        lora_id=lora_id,
        salt=salt,
    )


def _admit(kv: KVCache, req: SimRequest) -> int:
    """Allocate a whole prompt the way the scheduler admits it; return the hit in tokens."""
    hit = kv.computed_blocks(req)
    assert kv.allocate(req, req.num_tokens - len(hit) * BS, hit)
    return len(hit) * BS


# --- tokenizer ---------------------------------------------------------------------------


def test_tokenize_is_xxh32_of_4_char_runs() -> None:
    text = "héllo wörld!"
    assert token_strs(text) == ["héll", "o wö", "rld!"]
    assert tokenize(text) == [xxhash.xxh32_intdigest(s.encode()) % 32000 for s in token_strs(text)]
    assert tokenize("abcde")[1] == xxhash.xxh32_intdigest(b"e") % 32000
    assert tokenize("") == []


@given(st.text(max_size=200) | st.text(alphabet="abc <|>\n", max_size=200))
@settings(max_examples=300, deadline=None)
def test_fast_ascii_path_gives_the_defined_ids(text: str) -> None:
    assert tokenize(text) == [xxhash.xxh32_intdigest(s.encode()) % 32000 for s in token_strs(text)]


def test_long_text_of_distinct_runs_gives_the_defined_ids() -> None:
    text = "".join(f"{i:04d}" for i in range(50_000)) + "ab"
    assert tokenize(text) == [xxhash.xxh32_intdigest(s.encode()) % 32000 for s in token_strs(text)]


@pytest.mark.parametrize(
    ("messages", "kwargs", "expected"),
    [
        pytest.param(
            [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
            {},
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
            "<|im_start|>assistant\n",
            id="generation-prompt",
        ),
        pytest.param(
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"},
                                          {"type": "text", "text": "b"}]}],
            {"add_generation_prompt": False},
            "<|im_start|>user\nab<|im_end|>\n",
            id="text-parts-concatenated",
        ),
        pytest.param(
            [{"role": "assistant", "content": "Sure"}],
            {"continue_final_message": True},
            "<|im_start|>assistant\nSure",
            id="continue-final-message",
        ),
        pytest.param([{"role": "user", "content": None}], {"add_generation_prompt": False},
                     "<|im_start|>user\n<|im_end|>\n", id="null-content"),
    ],
)  # fmt: skip
def test_render_chat(messages: list[dict[str, Any]], kwargs: dict[str, Any], expected: str) -> None:
    assert render_chat(messages, **kwargs) == expected


def test_output_text_tokenizes_back_to_its_length() -> None:
    for n in (1, 5, 40):
        assert len(tokenize(output_text(0, n))) == n


# --- prefix cache ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_len", "expected_hit"),
    [
        pytest.param(40, 32, id="partial-last-block-not-cached"),
        pytest.param(48, 32, id="whole-prompt-cached-last-block-recomputed"),
        pytest.param(49, 48, id="one-token-past-blocks"),
        pytest.param(15, 0, id="shorter-than-a-block"),
    ],
)
def test_second_identical_prompt_hits_full_blocks(prompt_len: int, expected_hit: int) -> None:
    kv = KVCache(64, BS, enable_prefix_caching=True)
    first = _req(range(prompt_len))
    assert _admit(kv, first) == 0
    kv.free(first)
    assert _admit(kv, _req(range(prompt_len))) == expected_hit


@pytest.mark.parametrize(
    ("a", "b", "hit"),
    [
        pytest.param({}, {}, 32, id="same-chain"),
        pytest.param({"salt": "t1"}, {"salt": "t1"}, 32, id="same-salt"),
        pytest.param({"salt": "t1"}, {"salt": "t2"}, 0, id="different-salt"),
        pytest.param({}, {"salt": "t1"}, 0, id="salt-vs-none"),
        pytest.param({"model": "m"}, {"model": "lora-a", "lora_id": 1}, 0, id="model-vs-lora"),
        pytest.param({"model": "x"}, {"model": "y"}, 0, id="different-model"),
    ],
)
def test_salt_and_model_isolate_chains(a: dict[str, Any], b: dict[str, Any], hit: int) -> None:
    kv = KVCache(64, BS, enable_prefix_caching=True)
    first = _req(range(40), **a)
    _admit(kv, first)
    kv.free(first)
    assert _admit(kv, _req(range(40), **b)) == hit


def test_salt_changes_every_block_hash_through_the_chain() -> None:
    plain, salted = _req(range(64)), _req(range(64), salt="s")
    assert not set(plain.block_hashes) & set(salted.block_hashes)


def test_lru_evicts_least_recently_freed_unreferenced_blocks() -> None:
    kv = KVCache(5, BS, enable_prefix_caching=True)  # 4 usable blocks
    a = _req(range(32), rid="a")  # 2 blocks
    _admit(kv, a)
    kv.take_events()
    kv.free(a)  # tail first: a's block 1 is now older than a's block 0 in LRU order
    b = _req(range(1000, 1048), rid="b")  # 3 blocks: 2 never-used ones, then one eviction
    _admit(kv, b)
    removed = [e for e in kv.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[a.block_hashes[1]]]
    assert kv.is_cached(a.block_hashes[0])
    assert not kv.is_cached(a.block_hashes[1])


def test_referenced_blocks_are_never_evicted() -> None:
    kv = KVCache(5, BS, enable_prefix_caching=True)
    running = _req(range(48), rid="running")  # 3 of 4 blocks, held
    _admit(kv, running)
    other = _req(range(500, 532), rid="other")  # needs 2, only 1 free
    assert not kv.allocate(other, 32, [])
    assert other.blocks == []
    assert all(kv.is_cached(h) for h in running.block_hashes)


def test_usage_counts_only_referenced_blocks() -> None:
    kv = KVCache(11, BS, enable_prefix_caching=True)
    req = _req(range(40))  # 3 blocks
    _admit(kv, req)
    assert kv.usage == pytest.approx(0.3)
    kv.free(req)
    assert kv.usage == 0.0
    assert kv.num_cached == 2


def test_block_stored_events_chain_and_carry_extra_keys() -> None:
    kv = KVCache(64, BS, enable_prefix_caching=True)
    req = _req(range(40), model="lora-a", lora_id=3, salt="tenant")
    hit = kv.computed_blocks(req)
    assert kv.allocate(req, 20, hit)  # a prefill chunk: tokens 0..19, block 0 full
    req.num_computed_tokens = 20  # what the scheduler's commit does
    assert kv.allocate(req, 20, [])  # tokens 20..39, block 1 full
    first, second = kv.take_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.parent_block_hash is None
    assert first.block_hashes == req.block_hashes[:1]
    assert first.token_ids == list(range(16))
    assert first.extra_keys == [("lora-a", "tenant")]
    assert (first.lora_id, first.lora_name, first.medium) == (3, "lora-a", "GPU")
    assert second.parent_block_hash == req.block_hashes[0]
    assert second.extra_keys == [("lora-a",)]


def test_blocks_computed_twice_are_announced_once() -> None:
    kv = KVCache(64, BS, enable_prefix_caching=True)
    a, b = _req(range(40), rid="a"), _req(range(40), rid="b")
    assert kv.allocate(a, 40, [])
    assert kv.allocate(b, 40, [])  # admitted without looking up the cache
    stored = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert len(stored) == 1


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use() -> None:
    kv = KVCache(8, BS, enable_prefix_caching=True)
    req = _req(range(32))
    _admit(kv, req)
    kv.take_events()
    assert not kv.reset_prefix_cache()
    kv.free(req)
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]
    assert kv.num_cached == 0


def test_disabled_prefix_caching_never_hits() -> None:
    kv = KVCache(64, BS, enable_prefix_caching=False)
    first = _req(range(40))
    _admit(kv, first)
    kv.free(first)
    assert _admit(kv, _req(range(40))) == 0
    assert kv.take_events() == []


# --- scheduler and timing ----------------------------------------------------------------


def _scheduler(**overrides: Any) -> Scheduler:
    params = SimParams(**{"num_gpu_blocks": 4096, "max_model_len": 4096, **overrides})
    return Scheduler(params, KVCache(params.num_gpu_blocks, BS, params.enable_prefix_caching))


def _run(sched: Scheduler, until: Any = None, max_steps: int = 10_000) -> float:
    """Step until `until()` (default: no work); return the simulated milliseconds."""
    elapsed = 0.0
    for _ in range(max_steps):
        if until() if until else not sched.has_work:
            return elapsed
        plan = sched.schedule()
        elapsed += sched.step_ms(plan)
        sched.commit(plan)
    raise AssertionError("did not converge")


def _ttft_ms(cached_tokens: int, prompt_len: int = 4000) -> float:
    sched = _scheduler()
    warm = _req(range(cached_tokens + 1), rid="warm", max_tokens=1)
    sched.add(warm)
    _run(sched)
    req = _req(range(prompt_len), rid="probe")
    sched.add(req)
    ms = _run(sched, until=lambda: req.num_output > 0)
    assert req.num_cached_tokens == cached_tokens // BS * BS
    return ms


def test_ttft_grows_with_uncached_prompt_tokens() -> None:
    ttfts = [_ttft_ms(cached) for cached in (3984, 3000, 2000, 1000, 0)]
    assert ttfts == sorted(ttfts)
    assert ttfts[-1] > 10 * ttfts[0]


def test_ttft_grows_with_the_queue_ahead() -> None:
    sched = _scheduler(max_num_batched_tokens=2048)
    for i in range(3):
        sched.add(_req(range(i * 10_000, i * 10_000 + 3000), rid=f"ahead{i}", max_tokens=1))
    probe = _req(range(50_000, 50_100), rid="probe")
    sched.add(probe)
    alone = _scheduler(max_num_batched_tokens=2048)
    lone = _req(range(50_000, 50_100), rid="lone")
    alone.add(lone)
    assert _run(sched, until=lambda: probe.num_output > 0) > 5 * _run(
        alone, until=lambda: lone.num_output > 0
    )


def test_step_time_model() -> None:
    sched = _scheduler(step_base_ms=20, decode_per_seq_ms=1, prefill_per_token_ms=0.5)
    a = _req(range(100), rid="a", max_tokens=3)
    sched.add(a)
    prefill = sched.schedule()
    assert (prefill.prefill_tokens, prefill.decode_seqs) == (100, 0)
    assert sched.step_ms(prefill) == 20 + 0.5 * 100
    sched.commit(prefill)
    decode = sched.schedule()
    assert (decode.prefill_tokens, decode.decode_seqs) == (0, 1)
    assert sched.step_ms(decode) == 21


def test_speed_divides_every_step() -> None:
    """Half speed: the same plan takes twice the simulated time, prefill and decode."""
    full, half = _scheduler(), _scheduler(speed=0.5)
    for sched in (full, half):
        sched.add(_req(range(300), rid="a", max_tokens=2))
    plans = [(full.schedule(), half.schedule())]
    full.commit(plans[0][0])
    half.commit(plans[0][1])
    plans.append((full.schedule(), half.schedule()))
    assert plans[1][0].decode_seqs == 1
    for fast, slow in plans:
        assert half.step_ms(slow) == 2 * full.step_ms(fast)


def test_speeds_flag_takes_one_comma_separated_list(capsys: Any) -> None:
    args = cli.build_parser().parse_args(["--instances", "3", "--speeds", "1,1,0.5"])
    assert args.speeds == [1.0, 1.0, 0.5]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--speeds", "1,fast"])
    assert "want numbers like 1,1,0.5, got '1,fast'" in capsys.readouterr().err


def test_chunked_prefill_respects_the_token_budget() -> None:
    sched = _scheduler(max_num_batched_tokens=32)
    req = _req(range(100), max_tokens=1)
    sched.add(req)
    steps = 0
    while req.num_output == 0:
        plan = sched.schedule()
        assert sum(n for _, n in plan.scheduled) <= 32
        sched.commit(plan)
        steps += 1
    assert steps == 4


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched = _scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add(_req(range(i * 100, i * 100 + 20), rid=str(i)))
    plan = sched.schedule()
    assert [r.request_id for r, _ in plan.scheduled] == ["0", "1"]
    assert len(sched.waiting) == 3


def test_preemption_when_kv_blocks_run_out() -> None:
    # 8 usable blocks; each request grows from 3 to 6 blocks, so both cannot finish together.
    sched = _scheduler(num_gpu_blocks=9, max_model_len=128)
    reqs = [_req(range(i * 1000, i * 1000 + 48), rid=str(i), max_tokens=40) for i in range(2)]
    for r in reqs:
        sched.add(r)
    _run(sched)
    assert all(r.finished and r.finish_reason == "length" for r in reqs)
    assert reqs[1].num_preemptions > 0  # the later admission is the victim
    assert reqs[0].num_preemptions == 0
    assert sched.kv.usage == 0.0


def test_abort_frees_blocks_and_finishes() -> None:
    sched = _scheduler()
    req = _req(range(64), max_tokens=100)
    sched.add(req)
    sched.commit(sched.schedule())
    sched.abort(req)
    assert (req.status, req.finish_reason) == (Status.FINISHED, "abort")
    assert not sched.has_work
    assert sched.kv.usage == 0.0


# --- KV event encoding -------------------------------------------------------------------


_STORED = BlockStored(
    block_hashes=[2**64 - 1],
    parent_block_hash=None,
    token_ids=[1] * 16,
    block_size=16,
    lora_id=None,
    medium="GPU",
    lora_name=None,
    kv_cache_spec_kind="full_attention",
)


def test_array_encoding_is_positional_with_every_field() -> None:
    ts, events, rank = msgspec.msgpack.decode(
        encode_batch(1.5, [_STORED, BlockRemoved([7], "GPU"), AllBlocksCleared()], "array")
    )
    assert (ts, rank) == (1.5, 0)
    assert events == [
        ["BlockStored", [2**64 - 1], None, [1] * 16, 16, None, "GPU", None, None, None,
         "full_attention", None],
        ["BlockRemoved", [7], "GPU", None],
        ["AllBlocksCleared"],
    ]  # fmt: skip


def test_map_encoding_omits_none_defaults() -> None:
    _, events, _ = msgspec.msgpack.decode(
        encode_batch(1.5, [_STORED, BlockRemoved([7], "GPU"), AllBlocksCleared()], "map")
    )
    assert events == [
        {"type": "BlockStored", "block_hashes": [2**64 - 1], "parent_block_hash": None,
         "token_ids": [1] * 16, "block_size": 16, "lora_id": None, "medium": "GPU",
         "lora_name": None, "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]  # fmt: skip


# --- config and CLI ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        pytest.param({"sede": 1}, "unknown field `sede`", id="unknown-field"),
        pytest.param({"block_size": 0}, "`$.block_size`", id="bound"),
        pytest.param({"max_model_len": 10**7}, "exceeds the KV capacity", id="capacity"),
        pytest.param({"faults": {4: {"mode": "hang"}}}, "only 0..3 exist", id="fault-index"),
        pytest.param({"faults": {0: {"mode": "boom"}}}, "`$.faults[...].mode`", id="fault-mode"),
        pytest.param({"kv_events_topic": "kv@{pod}"}, "kv_events_topic", id="topic-field"),
        pytest.param({"speeds": [1, 0.5]}, "2 speeds for 4 instances", id="speeds-count"),
        pytest.param({"instances": 2, "speeds": [1, 0]}, "`$.speeds[1]`", id="speed-bound"),
    ],
)
def test_config_is_checked_once(raw: dict[str, Any], error: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=re.escape(error)):
        msgspec.convert(raw, SimConfig)


def test_flags_override_the_yaml_file(tmp_path: Any) -> None:
    path = tmp_path / "sim.yaml"
    path.write_text("instances: 3\ntime_scale: 0.5\nfaults: {1: {mode: slow, factor: 2}}\n")
    config = load_config(str(path), {"time_scale": 0.1})
    assert (config.instances, config.time_scale) == (3, 0.1)
    assert config.faults == {1: Fault(mode="slow", factor=2.0)}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        pytest.param("0:fail", (0, Fault(mode="fail")), id="fail-default"),
        pytest.param("1:fail:500", (1, Fault(mode="fail", status=500)), id="fail-status"),
        pytest.param("2:hang", (2, Fault(mode="hang")), id="hang"),
        pytest.param("0:close_midstream:1", (0, Fault(mode="close_midstream", after_chunks=1)),
                     id="close"),
        pytest.param("3:slow:2.5", (3, Fault(mode="slow", factor=2.5)), id="slow"),
    ],
)  # fmt: skip
def test_fault_flag(spec: str, expected: tuple[int, Fault]) -> None:
    assert cli._parse_fault(spec) == expected


def test_every_param_has_a_flag_with_help() -> None:
    parser = cli.build_parser()
    flags = {a.dest: a for a in parser._actions}
    for name in SimConfig.__struct_fields__:
        if name != "faults":
            assert flags[name].help and "default" in flags[name].help


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--fault", "x:fail"], id="bad-index"),
        pytest.param(["--fault", "0:hang:1"], id="arg-for-hang"),
        pytest.param(["--block-size", "0"], id="bound"),
        pytest.param(["--config", "/nonexistent/sim.yaml"], id="missing-file"),
        pytest.param(["-c", "/nonexistent/sim.yaml"], id="missing-file-short-flag"),
        pytest.param(["--instances", "2", "--speeds", "1"], id="speeds-count"),
    ],
)
def test_cli_rejects_bad_config_with_status_2(argv: list[str], capsys: Any) -> None:
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith("kvroute sim:")


def test_the_cli_prints_each_servers_url_and_names_the_model() -> None:
    """stdout: one URL per server (a harness reads them); stderr: the model to ask for."""
    cmd = [sys.executable, "-m", "bench.sim", "--instances", "2", "--model", "m-demo"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        urls = [proc.stdout.readline().strip() for _ in range(2)]
        said = proc.stderr.readline()
    finally:
        proc.terminate()
        proc.wait(10)
    assert all(url.startswith("http://127.0.0.1:") for url in urls), urls
    assert said.strip() == "kvroute sim: 2 servers of model 'm-demo'"


def test_the_server_count_is_instances_not_backends(capsys: Any) -> None:
    """A count, named apart from `kvroute serve --backend URL`; the old name is gone."""
    assert cli.build_parser().parse_args(["--instances", "3"]).instances == 3
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["--backends", "3"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --backends" in capsys.readouterr().err
