"""A real redis-server for the tests, on 127.0.0.1 at a free port, nothing persisted;
skipped, with the reason, where redis-server is not installed (.ci/run installs it)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

_START_SECONDS = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def redis_server(
    workdir: Path, password: str | None = None, port: int | None = None
) -> Iterator[str]:
    """Its URL while it runs; stopped (and waited for) on the way out. `port`: the one
    it listens on (a restarted server where the last one was), else a free one."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian's redis-server package)")
    port = port or _free_port()
    args = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
            "--appendonly", "no", "--dir", str(workdir)]  # fmt: skip
    if password is not None:
        args += ["--requirepass", password]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + _START_SECONDS
        while True:  # until it accepts a connection, bounded
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
