"""The usage records' windows, written and summed back."""

from __future__ import annotations

import pytest

from router import usage_records
from router.config import ConfigError
from router.usage_records import UsageRecords


async def test_windows_are_written_and_summed_by_tenant_model_and_pool(tmp_path) -> None:
    path = str(tmp_path / "sub" / "usage.db")
    now = [100.0]
    records = UsageRecords(path, 60, clock=lambda: now[0])
    records.add("acme", "m", "(none)", 10, 4, 2)
    records.add("acme", "m", "(none)", 5, None, 1)
    records.add("beta", "m", "fast", 7, 0, 3)
    now[0] = 160.0
    await records.flush()
    records.add("acme", "m", "(none)", 1, 1, 1)
    now[0] = 220.0
    await records.flush()
    await records.flush()  # an empty window writes nothing
    acme, beta = usage_records.read(path, 0, 1e12)
    assert acme == {
        "tenant": "acme", "model": "m", "pool": "(none)", "from": 100.0, "to": 220.0,
        "requests": 3, "prompt_tokens": 16, "cached_tokens": 5, "completion_tokens": 4,
    }  # fmt: skip
    assert (beta["tenant"], beta["pool"], beta["requests"]) == ("beta", "fast", 1)
    (first,) = usage_records.read(path, 0, 150, "acme")  # windows begun before 150
    assert first["requests"] == 2
    assert usage_records.read(path, 0, 1e12, "nobody") == []


def test_a_database_that_cannot_be_made_is_a_config_error(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"usage\.path: cannot open"):
        UsageRecords(str(blocker / "usage.db"), 60)
