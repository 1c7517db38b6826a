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


class RedisServer:
    """A redis-server on one port that a test may stop and start again (nothing kept
    in between)."""

    def __init__(self, workdir: Path, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (Debian's redis-server package)")
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._args = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                      "--appendonly", "no", "--dir", str(workdir)]  # fmt: skip
        if password is not None:
            self._args += ["--requirepass", password]
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start it, and return once it accepts a connection (bounded)."""
        proc = self._proc = subprocess.Popen(
            self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + _START_SECONDS
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def stop(self) -> None:
        """Stop it, and wait for it to end."""
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._proc = None


@contextmanager
def redis_server(workdir: Path, password: str | None = None) -> Iterator[str]:
    """Its URL while it runs; stopped (and waited for) on the way out."""
    server = RedisServer(workdir, password)
    try:
        server.start()
        yield server.url
    finally:
        server.stop()
