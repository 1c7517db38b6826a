"""`python -m bench.studies.fleet_upkeep` at a small size: real processes on 127.0.0.1 (the
raw instant backend on several ports, each with a vLLM /metrics page, and kvroute with a
collector and two workers in front of them)."""

from __future__ import annotations

import orjson
import pytest

from bench.studies import fleet_upkeep

pytestmark = pytest.mark.timeout(180)


def test_small_run_waits_for_every_backend_scraped_and_measures_it(tmp_path, capsys) -> None:
    """The study only measures once a worker shows every backend's scrape: the raw
    backend's page reads as a vLLM one, through the collector's feed, at both sizes."""
    out = tmp_path / "upkeep.json"
    argv = ["--backends", "2,6", "--seconds", "1.5", "--workers", "2", "--json", str(out)]
    assert fleet_upkeep.main(argv) == 0
    rows = orjson.loads(out.read_bytes())
    assert [(r["router"], r["backends"]) for r in rows] == [
        ("kvroute KV_AWARE", 2),
        ("kvroute KV_AWARE", 6),
    ]
    for r in rows:
        assert r["total_ms"] >= 0 and r["collector_ms"] >= 0 and r["workers_ms"] >= 0
    printed = capsys.readouterr().out
    assert "| router | backends | collector (ms/s) | workers (ms/s) |" in printed
    assert "| kvroute KV_AWARE | 6 |" in printed
