"""`python -m bench.studies.throughput --quick`: every phase runs against real processes on
127.0.0.1 (the raw backend, kvroute with 1 and with N workers). The Rust peers are
pointed at an empty virtualenv path and never pip-installed, so the run is the same on
every machine whatever its ~/.cache holds: their rows say why they were not measured."""

from __future__ import annotations

import shutil

import orjson
import pytest

from bench.studies import throughput

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(shutil.which("wrk") is None, reason=throughput.WRK_HINT),
]


def test_quick_run_fills_every_cell_it_can(tmp_path, capsys) -> None:
    out = tmp_path / "throughput.json"
    argv = ["--quick", "--no-install", "--peers-venv", str(tmp_path / "no-peers")]
    assert throughput.main([*argv, "--json", str(out)]) == 0
    rows = {r["name"]: r for r in orjson.loads(out.read_bytes())["rows"]}
    printed = capsys.readouterr().out

    direct = rows.pop("backend direct (baseline)")
    assert direct["rps"] > 0 and direct["sse_eps"] > 0 and direct["wrk_errors"] == 0
    kvroute = {name: r for name, r in rows.items() if name.startswith("kvroute")}
    assert "kvroute --workers 1" in kvroute
    for peer in throughput.PEERS:
        row = rows.pop(peer)
        assert row["rps"] is None and "not installed" in row["note"], peer
    for name, row in rows.items():
        assert row["rps"] > 0 and row["rps_cores"] > 0, name
        assert set(row["latency"]) == {"seq", "c64"}, name
        assert row["sse_eps"] > 0 and row["sse_errors"] == 0, name
        assert row["mem_mb_per_1k"] is not None, name
        assert row["wrk_errors"] == 0, name
        assert f"| {name} |" in printed
    assert "- req/s" not in printed  # the ratio to sglang-router needs its row
