"""What reading a backend's /metrics page costs the collector, once per backend a second.

Run: .venv/bin/pytest bench/micro/test_bench_scrape.py --benchmark-enable

The page is the simulator's (vLLM's names, buckets and labels: 13 KB, ~300 lines, two
thirds of them histogram buckets) with a busy backend's values. The baselines read the
same series: `library_parser` with prometheus-client's own text parser, `every_line`
splitting every line and keeping the routing ones (the router's reader until 2026-12);
`routing_series` is router/telemetry/scrape.py's one-pass read. Compare the ratios, not
the times.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.sim.metrics import SimMetrics
from bench.sim.params import SimParams
from router.telemetry.scrape import parse_vllm_metrics

_SUMMED = {"vllm:num_requests_running": "running", "vllm:prompt_tokens_total": "prompt"}


@pytest.fixture(scope="module")
def page() -> bytes:
    metrics = SimMetrics(SimParams())
    metrics.running.set(12)
    metrics.prompt_tokens.inc(123_456)
    for gap in (0.01, 0.02, 0.04, 0.08):
        metrics.itl.observe(gap)
        metrics.ttft.observe(gap * 10)
    return metrics.render()


def _library(page: bytes) -> dict[str, float]:
    found = dict.fromkeys(_SUMMED.values(), 0.0)
    for family in text_string_to_metric_families(page.decode()):
        for sample in family.samples:
            if sample.name in _SUMMED:
                found[_SUMMED[sample.name]] += sample.value
    return found


def _every_line(page: bytes) -> dict[str, float]:
    found = dict.fromkeys(_SUMMED.values(), 0.0)
    for line in page.decode().splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        name, value = (name, rest.rpartition("} ")[2]) if rest else line.split(" ")[:2]
        if name in _SUMMED:
            found[_SUMMED[name]] += float(value.split()[0])
    return found


def test_baseline_every_line(benchmark, page: bytes) -> None:
    assert benchmark(_every_line, page) == {"running": 12.0, "prompt": 123_456.0}


def test_baseline_library_parser(benchmark, page: bytes) -> None:
    assert benchmark(_library, page) == {"running": 12.0, "prompt": 123_456.0}


def test_routing_series(benchmark, page: bytes) -> None:
    snap = benchmark(parse_vllm_metrics, page)
    assert (snap.running, snap.prompt_tokens, snap.itl_count) == (12.0, 123_456.0, 4.0)
