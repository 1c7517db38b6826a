"""`python -m bench.throughput --quick`: every phase runs against real processes on
127.0.0.1 (the raw backend, kvroute with 1 and with N workers, and the Rust peers when
their virtualenv is already there; this test never pip-installs them)."""

from __future__ import annotations

import shutil

import orjson
import pytest

from bench import throughput

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(shutil.which("wrk") is None, reason=throughput.WRK_HINT),
]


def test_quick_run_fills_every_cell_it_can(tmp_path, capsys) -> None:
    out = tmp_path / "throughput.json"
    assert throughput.main(["--quick", "--no-install", "--json", str(out)]) == 0
    rows = {r["name"]: r for r in orjson.loads(out.read_bytes())["rows"]}
    printed = capsys.readouterr().out

    direct = rows.pop("backend direct (baseline)")
    assert direct["rps"] > 0 and direct["sse_eps"] > 0 and direct["wrk_errors"] == 0
    kvroute = {name: r for name, r in rows.items() if name.startswith("kvroute")}
    assert "kvroute --workers 1" in kvroute
    for name, row in rows.items():
        if name not in kvroute and row["rps"] is None:  # a peer that is not installed
            assert "not installed" in row["note"]
            continue
        assert row["rps"] > 0 and row["rps_cores"] > 0, name
        assert set(row["latency"]) == {"seq", "c64"}, name
        assert row["sse_eps"] > 0 and row["sse_errors"] == 0, name
        assert row["mem_mb_per_1k"] is not None, name
        assert row["wrk_errors"] == 0, name
        assert f"| {name} |" in printed
    assert "- req/s" in printed or "sglang-router" not in rows
