"""`python -m bench.studies.metrics_scrape` at a small scale: a real router with two
workers in front of four backend ports, scraped and probed over real sockets."""

from __future__ import annotations

import orjson
import pytest

from bench.studies import metrics_scrape

pytestmark = pytest.mark.timeout(180)


def test_small_run_scrapes_every_worker_and_probes_beside_the_scrapes(tmp_path, capsys) -> None:
    out = tmp_path / "scrape.json"
    argv = ["--backends", "4", "--workers", "2", "--scrapes", "4", "--small", "30"]
    assert metrics_scrape.main([*argv, "--json", str(out)]) == 0
    result = orjson.loads(out.read_bytes())
    # each backend's primed series are on the page: ~140 a backend
    assert result["series"] > 4 * 100 and result["page_bytes"] > 10_000
    assert len(result["first_scrapes_s"]) == 2 and result["later_scrape_p50_s"] > 0
    assert result["scrapes_meanwhile"] >= 1
    assert result["small_p99_alone_ms"] > 0 and result["small_p99_scraped_ms"] > 0
    assert "while scraped back to back" in capsys.readouterr().out
