"""The page of every process's metric files (router/metrics/merged.py) against
prometheus-client's own merge of the same files, written by prometheus-client's own
file writer: the same families, samples and values, after each change the files see
(values rewritten, series appended, a process's live gauges gone, a file grown)."""

from __future__ import annotations

import math
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from router.metrics.merged import MergedFiles

_BOUNDS = ("-10.0", "0.0", "5.0", "+Inf")


def _families(text: str) -> dict[str, tuple]:
    """name -> (type, help, sorted samples): what a scraper reads, order aside."""
    out = {}
    for f in text_string_to_metric_families(text):
        samples = sorted((s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples)
        out[f.name] = (f.type, f.documentation, samples)
    return out


def _library(path: Path) -> dict[str, tuple]:
    """prometheus-client's page of `path`, without the `_sum` of a histogram whose
    buckets go below zero (kvroute leaves it out: such a sum can fall)."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(path))
    fams = _families(generate_latest(registry).decode())
    for name, (typ, doc, samples) in fams.items():
        below = any(float(dict(lab).get("le", 0)) < 0 for _, lab, _ in samples)
        if typ == "histogram" and below:
            fams[name] = (typ, doc, [s for s in samples if s[0] != name + "_sum"])
    return fams


class _Process:
    """The files one process writes, through prometheus-client's writer."""

    def __init__(self, path: Path, pid: int) -> None:
        self._files: dict[str, MmapedDict] = {}
        self._path, self._pid = path, pid

    def write(self, kind: str, metric: str, name: str, labels: dict, value: float) -> None:
        file = self._files.get(kind)
        if file is None:
            file = self._files[kind] = MmapedDict(str(self._path / f"{kind}_{self._pid}.db"))
        key = mmap_key(metric, name, list(labels), list(labels.values()), f"{metric} help")
        file.write_value(key, value, 0.0)

    def histogram(self, metric: str, labels: dict, counts: list[float], total: float) -> None:
        for le, n in zip(_BOUNDS, counts, strict=True):
            self.write("histogram", metric, metric + "_bucket", {**labels, "le": le}, n)
        self.write("histogram", metric, metric + "_sum", labels, total)

    def close(self) -> None:
        for file in self._files.values():
            file.close()


def _fill(proc: _Process, scale: float, backends: range) -> None:
    for b in backends:
        labels = {"backend": f'b{b} "quoted"\\ \n', "status": "200"}
        proc.write("counter", "kvroute_requests", "kvroute_requests_total", labels, scale * b)
        proc.histogram("kvroute_ttft_seconds", {"backend": f"b{b}"}, [scale, 0, 2, b], 3.5)
        proc.write("gauge_livemax", "kvroute_up", "kvroute_up", {"backend": f"b{b}"}, scale + b)
        proc.write("gauge_livesum", "kvroute_depth", "kvroute_depth", {"pool": "p"}, scale)
    proc.histogram("kvroute_error_tokens", {}, [1, 2, 3, 4], -7.0)
    proc.write("counter", "kvroute_plain", "kvroute_plain_total", {}, scale)


def test_the_merged_page_is_the_librarys_through_every_change(tmp_path: Path) -> None:
    one, two = _Process(tmp_path, 101), _Process(tmp_path, 202)
    merged = MergedFiles(str(tmp_path))
    try:
        _fill(one, 1.0, range(3))
        _fill(two, 2.0, range(2, 5))
        assert _families(merged.text()) == _library(tmp_path)
        # values rewritten in place only; then with a new series in one process, then
        # thousands more: the file grows (remapped) past its first size
        _fill(one, 4.0, range(3))
        assert _families(merged.text()) == _library(tmp_path)
        _fill(one, 5.0, range(3))
        one.write("counter", "kvroute_new", "kvroute_new_total", {"reason": "x"}, 1.0)
        assert _families(merged.text()) == _library(tmp_path)
        _fill(two, 3.0, range(2, 2000))
        page = merged.text()
        assert _families(page) == _library(tmp_path)
        line = r'kvroute_requests_total{backend="b1999 \"quoted\"\\ \n",status="200"} 5997.0'
        assert line in page
        # a process gone: its live gauge files are removed (mark_process_dead)
        two.close()
        for live in tmp_path.glob("gauge_live*_202.db"):
            live.unlink()
        after = _families(merged.text())
        assert after == _library(tmp_path)
        assert "kvroute_up" in after and len(after["kvroute_up"][2]) == 3
        assert after["kvroute_depth"][2] == [("kvroute_depth", (("pool", "p"),), 5.0)]
    finally:
        one.close()
        two.close()


def test_a_file_of_another_kind_goes_through_the_library(tmp_path: Path) -> None:
    """A gauge of a mode the page does not merge itself (`all`: one series a process)."""
    proc = _Process(tmp_path, 7)
    try:
        proc.write("gauge_all", "kvroute_each", "kvroute_each", {}, 4.0)
        proc.write("counter", "kvroute_plain", "kvroute_plain_total", {}, 2.0)
        fams = _families(MergedFiles(str(tmp_path)).text())
        assert fams == _library(tmp_path)
        assert fams["kvroute_each"][2] == [("kvroute_each", (("pid", "7"),), 4.0)]
    finally:
        proc.close()


def test_a_histogram_counts_its_buckets_cumulatively(tmp_path: Path) -> None:
    proc = _Process(tmp_path, 9)
    try:
        proc.histogram("kvroute_e2e", {"backend": "b"}, [1, 2, 3, 4], 9.0)
        samples = _families(MergedFiles(str(tmp_path)).text())["kvroute_e2e"][2]
        buckets = {dict(lab)["le"]: v for name, lab, v in samples if name.endswith("_bucket")}
        assert buckets == {"-10.0": 1, "0.0": 3, "5.0": 6, "+Inf": 10}
        counts = [v for name, _, v in samples if name == "kvroute_e2e_count"]
        assert counts == [10] and not any(n == "kvroute_e2e_sum" for n, _, _ in samples)
        assert not any(math.isnan(v) for _, _, v in samples)
    finally:
        proc.close()
