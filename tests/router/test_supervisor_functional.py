"""Run directories of concurrent test runs: each run (tests/conftest.py) gives its
routers a parent directory of its own through $KVROUTE_RUN_PARENT, which the supervisor
honours, so two runs at once never see, nor sweep, each other's directories.

The routers and the runs here are processes of their own: plain tests, on no event loop.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from bench.harness.processes import free_port, process
from router.control.supervisor import RUN_PARENT_ENV, RUNDIR_PREFIX

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

#: one test of a run: says which parent its run got, then waits for the other run to say
#: so too (both runs are alive at once), within a bounded time
_PROBE = """
import os, time
from pathlib import Path

def test_says_its_parent():
    parent = os.environ["KVROUTE_RUN_PARENT"]
    assert Path(parent).is_dir()
    Path(os.environ["PROBE_OUT"]).write_text(parent)
    deadline = time.monotonic() + 60
    while not Path(os.environ["PROBE_PEER"]).exists():
        assert time.monotonic() < deadline, "the other run never started"
        time.sleep(0.05)
"""


def _until(found: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while (value := found()) is None:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _rundirs(parent: Path) -> set[Path]:
    return set(parent.glob(RUNDIR_PREFIX + "*"))


def test_a_router_of_this_run_keeps_its_run_directory_in_the_runs_parent() -> None:
    parent = Path(os.environ[RUN_PARENT_ENV])
    assert parent.is_dir() and parent != Path("/dev/shm")
    before = _rundirs(parent)
    cmd = [sys.executable, "-m", "router", "serve", "--backend", "http://127.0.0.1:1"]
    cmd += ["--port", str(free_port()), "--workers", "2", "--log-level", "warning"]
    with process(cmd, subprocess.DEVNULL) as router:  # inherits this run's environment
        (mine,) = _until(lambda: (_rundirs(parent) - before) or None, 30, "its run directory")
        router.terminate()
        assert router.wait(30) == 0
    assert not mine.exists()  # removed by its supervisor on the way out


def test_two_runs_at_once_get_parents_of_their_own(tmp_path: Path) -> None:
    probe = tmp_path / "probe_test.py"
    probe.write_text(_PROBE)
    outs = [tmp_path / "first", tmp_path / "second"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest"]
    runs = [
        subprocess.Popen(
            [*cmd, str(probe)],
            cwd=ROOT,
            env={**os.environ, "PROBE_OUT": str(out), "PROBE_PEER": str(peer)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for out, peer in zip(outs, reversed(outs), strict=True)
    ]
    for run in runs:
        output, _ = run.communicate(timeout=90)
        assert run.returncode == 0, output
    first, second = (Path(out.read_text()) for out in outs)
    assert first != second
    for parent in (first, second):
        assert parent.parent == Path(os.environ[RUN_PARENT_ENV])  # below the caller's one
        assert not parent.exists()  # each run removed its own when it ended
