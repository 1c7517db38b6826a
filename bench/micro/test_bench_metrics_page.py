"""What a /metrics scrape costs with several workers, at 256 backends.

Run: .venv/bin/pytest bench/micro/test_bench_metrics_page.py --benchmark-enable

Two processes' multiprocess files, written by prometheus-client's own writer, holding
what a kvroute worker holds per backend (the request counters of its statuses and
endpoints, the TTFT / inter-token / E2E histograms of two endpoints: ~140 series a
backend, ~36,000 a process). The baseline is prometheus-client's page of them
(`MultiProcessCollector` and `generate_latest`, what the router ran before); `merged`
is router/metrics/merged.py's page once it has decoded the files, with 1% of the values
changed between scrapes; `first` is its first scrape (every record decoded). Compare
the ratios, not the times.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

from router.metrics.merged import MergedFiles

BACKENDS = 256
PROCESSES = 2
_BOUNDS = [f"{0.001 * 2**i:g}" for i in range(18)] + ["+Inf"]


def _series(backend: int) -> list[tuple[str, str, str, dict[str, str]]]:
    """(file kind, metric, sample name, labels) of one backend's series."""
    out = []
    for endpoint in ("chat", "completion"):
        base = {"backend": f"b{backend}", "endpoint": endpoint, "model": "m"}
        for status in ("200", "502", "503", "504"):
            labels = {**base, "status": status, "strategy": "KV_AWARE"}
            out.append(("counter", "kvroute_requests", "kvroute_requests_total", labels))
        for metric in ("kvroute_ttft_seconds", "kvroute_itl_seconds", "kvroute_e2e_seconds"):
            out += [("histogram", metric, metric + "_bucket", {**base, "le": le}) for le in _BOUNDS]
            out.append(("histogram", metric, metric + "_sum", base))
    return out


class _Files:
    """The processes' files, and a way to change a share of their values."""

    def __init__(self, path: Path) -> None:
        self.files = [
            {kind: MmapedDict(str(path / f"{kind}_{pid}.db")) for kind in ("counter", "histogram")}
            for pid in range(PROCESSES)
        ]
        self.keys = [
            (kind, mmap_key(metric, name, list(labels), list(labels.values()), metric))
            for b in range(BACKENDS)
            for kind, metric, name, labels in _series(b)
        ]
        for files in self.files:
            for kind, key in self.keys:
                files[kind].write_value(key, 1.0, 0.0)
        self._turn = itertools.count(2)

    def change(self, share: float = 0.01) -> None:
        value = float(next(self._turn))
        for files in self.files:
            for kind, key in self.keys[:: int(1 / share)]:
                files[kind].write_value(key, value, 0.0)

    def close(self) -> None:
        for files in self.files:
            for file in files.values():
                file.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    path = tmp_path_factory.mktemp("metrics")
    made = _Files(path)
    yield path, made
    made.close()


def test_baseline_library_page(benchmark, files) -> None:
    path, made = files
    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(path))
    page = benchmark.pedantic(generate_latest, args=(registry,), setup=made.change, rounds=3)
    assert page.count(b"\n") > BACKENDS * 130


def test_merged_page(benchmark, files) -> None:
    path, made = files
    merged = MergedFiles(str(path))
    merged.text()
    page = benchmark.pedantic(merged.text, setup=made.change, rounds=20)
    assert page.count("\n") > BACKENDS * 130


def test_merged_first_page(benchmark, files) -> None:
    path, _ = files
    page = benchmark.pedantic(lambda: MergedFiles(str(path)).text(), rounds=3)
    assert page.count("\n") > BACKENDS * 130
