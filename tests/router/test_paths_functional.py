"""A path the config has the workers write that no worker can: `kvroute serve` (one
worker or several) and `serve --check` stop with one line naming the key and the path,
exit 2, before any worker starts. The path lies under a regular file, which no user can
write under, root included (the tests may run as root)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from router.control.supervisor import RUN_PARENT_ENV

#: each key, and the section that makes the workers write at it
KEYS = {
    "capture.path": lambda path: {"capture": {"enabled": True, "path": path}},
    "jobs.path": lambda path: {"jobs": {"enabled": True, "path": path}},
    "usage.path": lambda path: {"usage": {"records": True, "path": path}},
    "access_log.path": lambda path: {"access_log": {"path": path}},
}
MODES = {"check": ["--check"], "one worker": ["--workers", "1"], "workers": ["--workers", "2"]}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("key", KEYS)
def test_an_unwritable_path_stops_the_start_with_one_line(tmp_path: Path, key, mode) -> None:
    (tmp_path / "afile").write_text("")
    path = str(tmp_path / "afile" / "sub")
    config = tmp_path / "router.yaml"
    listen = {"host": "127.0.0.1", "port": 0}
    config.write_text(
        yaml.safe_dump(
            {"listen": listen, "backends": [{"url": "http://127.0.0.1:9"}], **KEYS[key](path)}
        )
    )
    runs = tmp_path / "run"
    runs.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "router", "serve", "-c", str(config), *MODES[mode]],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, RUN_PARENT_ENV: str(runs)},
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"kvroute: $.{key}: {path} is not writable (Not a directory)\n"
    assert not list(runs.iterdir())  # stopped before the supervisor made its run directory


def test_writable_paths_pass_the_check(tmp_path: Path) -> None:
    sections = {}
    for key, section in KEYS.items():
        sections |= section(str(tmp_path / "new" / key))
    sections["access_log"]["path"] = str(tmp_path / "access.log")  # its folder must exist
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"backends": [{"url": "http://127.0.0.1:9"}], **sections}))
    done = subprocess.run(
        [sys.executable, "-m", "router", "serve", "-c", str(config), "--check"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == "config OK: 1 backend, strategy KV_AWARE\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["router.yaml"]  # nothing made
