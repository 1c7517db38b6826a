"""bench.studies.jobs_pressure end to end, tiny: a real simulator process, kvroute serve with one
worker and jobs on, a streaming probe process; the bad batch file, the uploads and the
downloads are answered, and the worker's RSS stays within its body budget plus a
constant while they run (the downloads together are 9 times the budget)."""

from __future__ import annotations

import orjson

from bench.studies import jobs_pressure

#: the worker's own growth beside the bodies: buffers, SQLite's page cache, allocator slack
SLACK_MB = 24


def test_a_bad_batch_file_and_concurrent_uploads_and_downloads(tmp_path, capsys) -> None:
    out = tmp_path / "pressure.json"
    argv = ["--batch-mib=2", "--uploads=3", "--upload-mb=24", "--downloads=6", "--budget-mib=16"]
    assert jobs_pressure.main([*argv, f"--out={out}"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("step")
    batch, uploads, downloads = orjson.loads(out.read_bytes())["steps"]
    assert (batch["name"], batch["answers"]) == ("batch", [200, 200])
    assert (uploads["name"], uploads["answers"]) == ("uploads", [200, 200, 200])
    assert (downloads["name"], downloads["answers"]) == ("downloads", [200] * 6)
    budget_mb = 16 * 1.048576
    for step in (uploads, downloads):
        assert step["rss_peak_mb"] - step["rss_before_mb"] < budget_mb + SLACK_MB, step
