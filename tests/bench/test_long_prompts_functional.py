"""`python -m bench.studies.long_prompts` at small sizes: real processes on 127.0.0.1 (the instant
backend, kvroute in front of it), every row of the table and the probe measured."""

from __future__ import annotations

import orjson
import pytest

from bench.studies import long_prompts

pytestmark = pytest.mark.timeout(180)


def test_small_run_fills_the_table_and_the_probe(tmp_path, capsys) -> None:
    out = tmp_path / "long.json"
    argv = ["--sizes", "200,1000", "--requests", "3", "--workers", "1"]
    argv += ["--probe-tokens", "2000", "--probe-requests", "20", "--json", str(out)]
    assert long_prompts.main(argv) == 0
    data = orjson.loads(out.read_bytes())
    cells = {(c["router"], c["words"], c["mode"]): c for c in data["cells"]}
    assert set(cells) == {
        ("kvroute KV_AWARE", words, mode) for words in (200, 1000) for mode in long_prompts.MODES
    }
    for cell in cells.values():
        assert cell["p50_ms"] > 0 and cell["direct_p50_ms"] > 0 and cell["cpu_ms"] > 0, cell
    probes = {p["router"]: p for p in data["probes"]}
    assert set(probes) == {"the raw backend, direct", "kvroute KV_AWARE, 1 worker"}
    for probe in probes.values():
        assert probe["quiet_p99_ms"] > 0 and probe["busy_p99_ms"] > 0, probe
        assert probe["long_prompts"] > 0, probe
    printed = capsys.readouterr().out
    assert "| 1,000 | new |" in printed and "small-request P99" in printed


def test_a_body_is_new_per_index_and_as_long_as_its_words() -> None:
    first, second = long_prompts.chat_body(100, 0), long_prompts.chat_body(100, 1)
    assert first != second
    assert long_prompts.chat_body(100, 0) == first
    system = orjson.loads(long_prompts.chat_body(10_000, 0))["messages"][0]["content"]
    assert 60_000 < len(system) < 70_000  # ~6.5 characters a word
