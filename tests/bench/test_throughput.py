"""bench.studies.throughput's table: n/a cells with their reason, the goal lines."""

from __future__ import annotations

import pytest

from bench.studies.throughput import Row, table

META = {
    "cores": 2,
    "loadavg": (1.0, 1.0, 1.0),
    "rounds": 3,
    "wrk": "-t1 -c64 -d3s",
    "strategy": "ROUND_ROBIN",
    "sse": "1000 streams",
    "mem_streams": 2000,
}
LAT = {
    "seq": {"direct_p50_ms": 0.3, "direct_p99_ms": 0.9, "added_p50_ms": 0.5, "added_p99_ms": 1.5},
    "c64": {"direct_p50_ms": 9.0, "direct_p99_ms": 20.0, "added_p50_ms": 4.0, "added_p99_ms": 8.0},
}


def _rows() -> list[Row]:
    return [
        Row("backend direct (baseline)", rps=30000.0, sse_eps=50000.0),
        Row(
            "kvroute --workers 1",
            rps=1500.0,
            rps_cores=1.0,
            latency=LAT,
            sse_eps=20000.0,
            sse_cores=0.5,
            mem_mb_per_1k=12.0,
            mem_idle_mb=80.0,
        ),
        Row(
            "kvroute --workers 2",
            rps=3000.0,
            rps_cores=2.0,
            latency=LAT,
            mem_mb_per_1k=11.5,
            mem_idle_mb=250.0,
        ),
        Row("sglang-router", rps=5000.0, rps_cores=1.0, version="0.3.2"),
        Row("vllm-router", note="; pip install vllm-router failed: no matching distribution"),
    ]


@pytest.mark.parametrize(
    "needle",
    [
        pytest.param("| backend direct (baseline) | 30,000 | n/a | n/a | 0.30 / 0.90", id="direct"),
        pytest.param("| kvroute --workers 1 | 1,500 | 1.00 | 1,500 | 0.50 / 1.50 |", id="added"),
        pytest.param("| 20,000 | 0.50 | 40,000 | 12.0 |", id="sse-per-core"),
        pytest.param("| sglang-router | 5,000 | 1.00 | 5,000 | n/a | n/a |", id="unmeasured"),
        pytest.param("| n/a | pip install vllm-router failed: no matching", id="peer-reason"),
        pytest.param("v0.3.2", id="peer-version"),
        pytest.param("- req/s, kvroute --workers 2 / sglang-router: 0.60 (goal", id="ratio"),
        pytest.param("- req/s per router core, the same ratio: 0.30", id="ratio-per-core"),
        pytest.param("kvroute --workers 1: 0.50 ms (goal <= 0.35)", id="added-p50"),
        pytest.param("20,000 delivered, 40,000 per router core", id="sse-goal"),
        pytest.param("--workers 2: 11.5 MB per 1,000 open streams over 250 MB", id="memory"),
    ],
)
def test_table_cells(needle: str) -> None:
    assert needle in table(_rows(), META, 64)
