"""bench.studies.batch_impact end to end, tiny: a real simulator process, kvroute serve with jobs
on, the interactive replay alone and beside a batch submitted through the Files and
Batch API; every interactive request served, and batch lines run meanwhile."""

from __future__ import annotations

import orjson

from bench.studies import batch_impact


def test_the_replay_alone_and_beside_a_batch(tmp_path, capsys) -> None:
    out = tmp_path / "impact.json"
    argv = ["--backends=2", "--requests=30", "--rate=10", "--max-tokens=10"]
    argv += ["--batch-lines=40", "--batch-max-tokens=10", "--time-scale=0.1"]
    argv += ["--max-wall=60", f"--out={out}"]
    assert batch_impact.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("run               ok  fail  TTFT p50")
    alone, beside = orjson.loads(out.read_bytes())["runs"]
    assert (alone["batch"], alone["ok"], alone["failed"], alone["batch_ok"]) == (
        False, 30, 0, None,
    )  # fmt: skip
    assert (beside["batch"], beside["ok"], beside["failed"]) == (True, 30, 0)
    assert 0 <= beside["lines_done"] <= 40
    assert beside["batch_ok"] == 40  # waited for after the replay
    assert beside["batch_s"] > 0


def test_a_bad_setting_fails_before_anything_starts(capsys) -> None:
    assert batch_impact.main(["--spare-share=2"]) == 2
    assert "bench.studies.batch_impact:" in capsys.readouterr().err
