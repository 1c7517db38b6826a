"""`python -m bench.studies.flow` at a small scale: simulated backends and routers on 127.0.0.1."""

from __future__ import annotations

import pytest

from bench.studies import flow

pytestmark = pytest.mark.timeout(180)


def test_every_request_is_counted_and_each_refusal_has_its_reason(capsys) -> None:
    argv = ["--seconds", "1.5", "--probe-seconds", "1.5", "--time-scale", "0.5"]
    assert flow.main(argv) == 0
    printed = capsys.readouterr().out
    rows = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in printed.splitlines()
        if line.startswith("| ") and not line.startswith("| run")
    ]
    assert len(rows) == 10, printed  # each scenario alone, then on and off
    for _, _, sent, _, refused, failed, counted, *_ in rows:
        assert counted == "yes" and failed == "0" and int(sent) > 0, printed
        assert "no reason" not in refused, printed
