"""bench.studies.pools end to end, tiny: a real simulator process, kvroute serve with two pools,
a two-stage ramp; every request served, and what the router counts as spilled is
exactly what the fallback served."""

from __future__ import annotations

import orjson

from bench.studies import pools


def test_a_ramp_over_two_pools_loses_nothing_and_counts_every_spill(tmp_path, capsys) -> None:
    out = tmp_path / "pools.json"
    argv = ["--preferred=1", "--fallback=1", "--strategy=PREFIX_AWARE"]
    argv += ["--concurrency-threshold=1", "--stages=2,20", "--stage-requests=15"]
    argv += ["--time-scale=0.1", "--max-tokens=10", "--max-wall=60", f"--out={out}"]
    assert pools.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].startswith("rate/s   ok  fail  fallback")
    assert "30 requests, 0 failed" in printed
    report = orjson.loads(out.read_bytes())
    stages = report["stages"]
    assert [(s["rate"], s["ok"], s["failed"]) for s in stages] == [(2.0, 15, 0), (20.0, 15, 0)]
    served_by_fallback = sum(round(s["fallback_share"] * s["ok"]) for s in stages)
    assert report["spills"].get("saturated", 0.0) == served_by_fallback


def test_a_bad_setting_fails_before_anything_starts(capsys) -> None:
    assert pools.main(["--strategy=NOPE"]) == 2
    assert "bench.studies.pools:" in capsys.readouterr().err
