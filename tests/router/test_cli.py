"""The `kvroute` command line: what it prints for the commands that print."""

from __future__ import annotations

import policies
from router.__main__ import main


def test_policies_lists_each_strategy_once_with_when_to_use_it(capsys) -> None:
    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    named = [line.split()[0] for line in lines if not line.startswith(" ")]
    assert named == policies.names()
    indented = [line.strip() for line in lines if line.startswith(" ")]
    advice = [line for line in indented if not line.startswith("a pool may set: ")]
    assert len(advice) == len(named)
    assert all(line.startswith("use when ") and len(line) > len("use when ") for line in advice)
    for name, line in zip(named, (x for x in lines if not x.startswith(" ")), strict=True):
        assert line.count(name) == 1  # the summary does not repeat the name


def test_policies_lists_what_a_pool_may_set_for_the_strategies_that_have_some(capsys) -> None:
    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    tunable = {
        lines[i - 2].split()[0]: line.strip().removeprefix("a pool may set: ").split(", ")
        for i, line in enumerate(lines)
        if line.strip().startswith("a pool may set: ")
    }
    assert tunable == {
        name: sorted(policies.policy_class(name).params_type.pool_tunable)
        for name in policies.names()
        if policies.policy_class(name).params_type.pool_tunable
    }
    assert "max_queue_s" in tunable["KV_AWARE"]
    assert tunable["PREFIX_AWARE"] == ["concurrency_threshold", "load_factor", "load_floor"]
