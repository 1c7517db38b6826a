"""`python -m bench.studies.event_rate` on a small fleet: real fake backends publishing vLLM
event batches over ZMQ, a real `kvroute serve` with a collector and two workers."""

from __future__ import annotations

import pytest

from bench.studies import event_rate

pytestmark = pytest.mark.timeout(240)


def _cells(line: str) -> list[str]:
    return [c.strip().replace(",", "") for c in line.strip().strip("|").split("|")]


def test_two_backends_every_event_applied_and_seen_by_the_workers(capsys) -> None:
    argv = ["--backends", "2", "--rate", "200", "--seconds", "3", "--window", "32"]
    assert event_rate.main([*argv, "--workers", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("| backends")))
    assert lines[header + 1].startswith("|---:")
    cells = dict(zip(_cells(lines[header]), _cells(lines[header + 2]), strict=True))
    offered, applied = float(cells["offered ev/s"]), float(cells["applied ev/s"])
    assert cells["backends"] == "2"
    assert 0.8 * 400 <= offered <= 1.1 * 400  # 2 backends x 200 events/s
    assert 0.9 * offered <= applied <= offered * 1.01
    assert float(cells["applied/sent"]) == 1.0  # every event, once the backlog drained
    assert float(cells["collector CPU %"]) > 0
    assert float(cells["lag P50 ms"]) < 5000  # the workers show the batches published
    assert lines[-1].startswith("one core: ") and "backends at 200 events/s each" in lines[-1]
