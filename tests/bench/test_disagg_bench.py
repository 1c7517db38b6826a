"""bench.disagg end to end, tiny: a real simulator process in prefill and decode roles
behind kvroute serve, then the same backends combined; both serve every request."""

from __future__ import annotations

import pytest

from bench import disagg


def test_disaggregated_and_combined_rows_serve_every_request(capsys) -> None:
    argv = ["--pd=1:1", "--requests=8", "--groups=2", "--rate=2", "--max-tokens=10"]
    assert disagg.main([*argv, "--time-scale=0.1", "--max-wall=60"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("mode")
    rows = {line.rsplit(None, 7)[0]: line.split()[-7:] for line in lines[1:3]}
    assert set(rows) == {"disaggregated 1:1", "combined 2"}
    assert all(cells[:2] == ["8", "0"] for cells in rows.values())  # ok, failed


@pytest.mark.parametrize("pd", ["2", "0:1", "a:b"])
def test_a_bad_split_is_refused_before_anything_starts(pd: str, capsys) -> None:
    assert disagg.main([f"--pd={pd}"]) == 2
    assert "--pd: expected P:D" in capsys.readouterr().err
