"""`python -m bench.studies.fairness` at a small scale: real processes on 127.0.0.1 (the raw
backend, kvroute with one worker, a holder process), the Rust peers left out."""

from __future__ import annotations

import pytest

from bench.studies import fairness
from router.control.supervisor import usable_cores

pytestmark = pytest.mark.timeout(180)


def test_every_target_opens_its_streams_and_answers_the_probes(capsys) -> None:
    argv = ["--streams", "50", "--interval", "0.05", "--probes", "5"]
    assert fairness.main([*argv, "--peers-venv", "/nonexistent"]) == 0
    printed = capsys.readouterr().out
    rows = {
        cells[1].strip(): [c.strip() for c in cells[2:-1]]
        for line in printed.splitlines()
        if line.startswith("| ") and not line.startswith("| target")
        for cells in [line.split("|")]
    }
    kvroutes = {f"kvroute --workers {n}" for n in (1, usable_cores())}
    assert set(rows) == {"backend direct", *kvroutes}, printed
    for name, (opened, failed, _, p50, p99, top, rate) in rows.items():
        assert (opened, failed) == ("50", "0"), (name, printed)
        assert 0 < float(p50) <= float(p99) <= float(top), (name, printed)
        assert float(rate.replace(",", "")) > 0, (name, printed)
