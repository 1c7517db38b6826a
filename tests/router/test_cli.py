"""The `kvroute` command line: what it prints for the commands that print."""

from __future__ import annotations

import policies
from router.__main__ import main


def test_policies_lists_each_strategy_once_with_when_to_use_it(capsys) -> None:
    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    named = [line.split()[0] for line in lines if not line.startswith(" ")]
    assert named == policies.names()
    advice = [line.strip() for line in lines if line.startswith(" ")]
    assert len(advice) == len(named)
    assert all(line.startswith("use when ") and len(line) > len("use when ") for line in advice)
    for name, line in zip(named, (x for x in lines if not x.startswith(" ")), strict=True):
        assert line.count(name) == 1  # the summary does not repeat the name
