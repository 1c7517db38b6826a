"""`python -m bench.studies.index_memory` at a small size: real processes on 127.0.0.1 (the
instant backend on several ports, kvroute at 1 and 2 workers in front of it)."""

from __future__ import annotations

import re

import orjson
import pytest

from bench.studies import index_memory

pytestmark = pytest.mark.timeout(180)


def test_small_run_measures_one_table_per_host(tmp_path, capsys) -> None:
    """Both routers learn the same entries; alone, the index is the process's own (no
    file); with 2 workers it is one set of files in the run directory, which the gauge,
    counting it once, matches."""
    out = tmp_path / "memory.json"
    # prompts enough that the growth stands above the processes' own ups and downs
    # (~200 KiB either way): ~24,400 entries, and each worker's keys of its prompts.
    # All of them, however the prompts spread: each backend shows a cache with room for
    # them (at the simulator's 384k tokens, 6,000 blocks a backend, 24,000 in all, would
    # be kept, fewer where one backend got more than its twelve prompts)
    argv = ["--backends", "4", "--requests", "48", "--words", "20000", "--workers", "1,2"]
    assert index_memory.main([*argv, "--json", str(out)]) == 0
    alone, two = orjson.loads(out.read_bytes())
    assert alone["workers"] == 1 and two["workers"] == 2
    assert alone["entries"] == two["entries"] > 48 * 500  # 508 blocks of 64 tokens a prompt
    assert alone["shared_files_bytes"] == 0
    assert two["shared_files_bytes"] > 0 and two["processes"] > alone["processes"]
    assert two["gauge_bytes"] == alone["gauge_bytes"] > 0
    assert alone["pss_bytes"] > 0 and two["pss_bytes"] > 0
    children = {"kvroute: collector", "kvroute: worker 0", "kvroute: worker 1"}
    assert children <= two["by_process"].keys()
    assert "kvroute: collector" not in alone["by_process"]
    printed = capsys.readouterr().out
    assert "| workers | processes | entries |" in printed
    per_process = r"\n2 worker\(s\), anonymous memory growth by process \(MiB\): .*collector \d"
    assert re.search(per_process, printed)
