"""`kvroute serve` on a port something else holds: one line naming the listener and its
address, exit 1, no traceback; with one worker and with several, for HTTP and gRPC."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness.processes import free_port
from router.control.supervisor import RUN_PARENT_ENV, RUNDIR_PREFIX


@pytest.fixture
def held_port():
    """A port a listening socket of this test holds on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("listener", ["HTTP", "gRPC"])
def test_a_busy_port_is_one_clear_line(
    held_port: int, workers: str, listener: str, tmp_path: Path
) -> None:
    ports = ["--port", str(held_port)] if listener == "HTTP" else ["--port", str(free_port())]
    if listener == "gRPC":
        ports += ["--grpc-port", str(held_port)]
    cmd = [sys.executable, "-m", "router", "serve", "--backend", "http://127.0.0.1:1"]
    env = {**os.environ, RUN_PARENT_ENV: str(tmp_path)}  # no other router's directories
    done = subprocess.run(
        [*cmd, *ports, "--workers", workers], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 1, done.stderr
    expected = f"kvroute: cannot listen on 127.0.0.1:{held_port} for {listener}: "
    assert expected in done.stderr
    assert "Traceback" not in done.stderr
    assert not list(tmp_path.glob(RUNDIR_PREFIX + "*"))  # it left no run directory behind
