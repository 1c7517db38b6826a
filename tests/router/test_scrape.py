"""What a /metrics page says to routing (router/telemetry/scrape.py): the series read
from a page rendered by prometheus_client under vLLM's names (the simulator's), the
names of older vLLM releases, and the decode sample between two scrapes."""

from __future__ import annotations

import dataclasses

import pytest

from bench.sim.metrics import SimMetrics
from bench.sim.params import SimParams
from router.fleet.speeds import MIN_DECODE_TOKENS
from router.telemetry.index_upkeep import cache_blocks
from router.telemetry.scrape import VllmSnapshot, decoded_between, parse_vllm_metrics


def test_a_vllm_page_gives_the_counters_and_the_inter_token_histogram() -> None:
    metrics = SimMetrics(SimParams())
    metrics.running.set(3)
    metrics.prompt_tokens.inc(1000)
    metrics.prefix_hits.inc(600)
    metrics.external_hits.inc(100)
    for gap in (0.02, 0.03, 0.05):
        metrics.itl.observe(gap)
    snap = parse_vllm_metrics(metrics.render())
    assert snap.running == 3
    assert (snap.prompt_tokens, snap.prefix_hits, snap.external_hits) == (1000, 600, 100)
    assert snap.itl_count == 3
    assert snap.itl_sum == pytest.approx(0.10)


def test_the_inter_token_histogram_of_older_releases_is_read_where_the_new_one_is_absent() -> None:
    old = (
        b'vllm:time_per_output_token_seconds_sum{engine="0",model_name="m"} 2.5\n'
        b'vllm:time_per_output_token_seconds_count{engine="0",model_name="m"} 100.0\n'
        b'vllm:time_per_output_token_seconds_sum{engine="1",model_name="m"} 0.5\n'
        b'vllm:time_per_output_token_seconds_count{engine="1",model_name="m"} 20.0\n'
    )
    snap = parse_vllm_metrics(old)
    assert (snap.itl_sum, snap.itl_count) == (3.0, 120.0)
    both = old + b'vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 1.0\n'
    both += b'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 40.0\n'
    snap = parse_vllm_metrics(both)  # a release exporting both: the new name, not their sum
    assert (snap.itl_sum, snap.itl_count) == (1.0, 40.0)


def test_engines_are_summed_usage_maxed_and_lookalike_names_skipped() -> None:
    """Two engines' lines of each series (the first line of the page among them), the
    KV usage the fuller engine's, a series without labels, a longer name that starts
    with a routing series' name, a bucket line, and the cache settings' labels."""
    page = (
        b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        b"# HELP vllm:num_requests_running Requests in model execution batches.\n"
        b'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        b'vllm:num_requests_running_peak{engine="0",model_name="m"} 99.0\n'
        b"vllm:num_requests_waiting 4.0\n"
        b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        b'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75\n'
        b'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.1",model_name="m"} 7.0\n'
        b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="2048"} 1.0\n'
        b'vllm:prompt_tokens_total{engine="0",model_name="m"} 1.5e3 1700000000000'
    )
    snap = parse_vllm_metrics(page)
    assert (snap.running, snap.waiting, snap.kv_usage) == (5.0, 4.0, 0.75)
    assert (snap.block_size, snap.num_gpu_blocks, snap.prompt_tokens) == (16, 2048, 1500.0)
    assert snap.itl_count == 0


def _scrape(at: float, **counts: float) -> VllmSnapshot:
    return VllmSnapshot(at=at, running=4.0, **counts)


def test_two_scrapes_give_the_mean_batch_gap_and_prefill_per_step() -> None:
    """Four streams decoding for a second at 25 ms a token: 160 tokens whose gaps sum to
    four seconds; 800 uncached prompt tokens prefilled over those 40 steps."""
    before = _scrape(10.0, itl_sum=1.0, itl_count=50, prompt_tokens=5000, prefix_hits=2000)
    after = dataclasses.replace(
        before, at=11.0, itl_sum=5.0, itl_count=210, prompt_tokens=6000, prefix_hits=2200
    )
    running, gap, beside = decoded_between(before, after)
    assert running == pytest.approx(4.0)
    assert gap == pytest.approx(0.025)
    assert beside == pytest.approx(800 / 40)


@pytest.mark.parametrize(
    "change",
    [
        {"running": 0.0},  # idle at the end: its mean would count idle time
        {"itl_count": 50 + MIN_DECODE_TOKENS - 1, "itl_sum": 1.2},  # too few tokens
        {"itl_count": 10, "itl_sum": 0.2},  # the backend restarted: counters start over
        {"prompt_tokens": 100},
    ],
)
def test_no_sample_from_an_idle_end_few_tokens_or_a_restart(change: dict) -> None:
    before = _scrape(10.0, itl_sum=1.0, itl_count=50, prompt_tokens=5000)
    after = dataclasses.replace(before, at=11.0, itl_sum=5.0, itl_count=210, prompt_tokens=6000)
    assert decoded_between(before, after) is not None
    assert decoded_between(before, dataclasses.replace(after, **change)) is None


def test_a_scraped_cache_is_counted_in_the_index_blocks() -> None:
    """vLLM's cache_config_info counts its own blocks; the index sizes a backend in its
    blocks, which without KV events are the router's own (64 tokens, not 16)."""
    snap = VllmSnapshot(num_gpu_blocks=100, block_size=16)
    assert cache_blocks(snap, 64) == 25
    assert cache_blocks(snap, 16) == 100
    assert cache_blocks(VllmSnapshot(num_gpu_blocks=100), 64) == 100  # its size unknown
    assert cache_blocks(VllmSnapshot(num_gpu_blocks=1, block_size=16), 64) == 1
