"""bench.jobs_pressure end to end, tiny: a real simulator process, kvroute serve with one
worker and jobs on, a streaming probe process; the bad batch file and the uploads are
answered, and the worker's RSS stays under its body budget."""

from __future__ import annotations

import orjson

from bench import jobs_pressure


def test_a_bad_batch_file_and_concurrent_uploads(tmp_path, capsys) -> None:
    out = tmp_path / "pressure.json"
    argv = ["--batch-mib=2", "--uploads=3", "--upload-mb=8", "--budget-mib=64"]
    assert jobs_pressure.main([*argv, f"--out={out}"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("step")
    batch, uploads = orjson.loads(out.read_bytes())["steps"]
    assert (batch["name"], batch["answers"]) == ("batch", [200, 200])
    assert (uploads["name"], uploads["answers"]) == ("uploads", [200, 200, 200])
    assert uploads["rss_peak_mb"] - uploads["rss_before_mb"] < 64 * 1.048576
