"""A worker's compact metric values (router/metrics/values.py) write the files
prometheus-client's own values write: the same operations through both, each in a
process of its own (the value class is the process's), read back by the library's
merge, give the same page; a file opened again keeps its values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from router.metrics.values import _TWO, _File

_WRITE = r"""
import os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
if sys.argv[2] == "compact":
    from router.metrics.values import use
    use()
else:
    values.ValueClass = values.MultiProcessValue()
r = CollectorRegistry()
c = Counter("kvroute_c", "a counter", ["backend"], registry=r)
g = Gauge("kvroute_g", "a gauge", ["backend"], multiprocess_mode="livemax", registry=r)
h = Histogram("kvroute_h", "a histogram", ["backend"], buckets=(-1, 0.5, 2), registry=r)
for i in range(3000):  # past the files' first size
    c.labels(f"b{i}").inc(i)
    g.labels(f"b{i % 7}").set(i)
    h.labels(f"b{i % 11}").observe(i / 1000 - 1)
c.labels("b5").inc(0.25)
g.labels("b1").dec(1)
print(c.labels("b5")._value.get(), g.labels("b1")._value.get())
"""


def _page(path: Path) -> dict:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(path))
    return {
        f.name: sorted((s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples)
        for f in text_string_to_metric_families(generate_latest(registry).decode())
    }


def _write(path: Path, kind: str) -> str:
    run = [sys.executable, "-c", _WRITE, str(path), kind]
    return subprocess.run(run, check=True, capture_output=True, text=True, timeout=60).stdout


def test_compact_values_write_the_librarys_files(tmp_path: Path) -> None:
    compact, library = tmp_path / "compact", tmp_path / "library"
    compact.mkdir()
    library.mkdir()
    assert _write(compact, "compact") == _write(library, "library") == "5.25 2996.0\n"
    page = _page(compact)
    assert page == _page(library)
    assert ("kvroute_c_total", (("backend", "b2999"),), 2999.0) in page["kvroute_c"]


def test_a_file_opened_again_finds_its_values(tmp_path: Path) -> None:
    """A process whose pid was used before appends to that file (as the library's
    values do): a key it holds keeps its place and value, a new one goes after."""
    path = str(tmp_path / "counter_1.db")
    first = _File(path)
    at = first.place("kvroute_a")
    _TWO.pack_into(first.map, at, 7.0, 0.0)
    first.place("kvroute_b")
    again = _File(path)
    assert again.place("kvroute_a") == at
    assert _TWO.unpack_from(again.map, at)[0] == 7.0
    assert again.place("kvroute_c") > again.place("kvroute_b") > at
