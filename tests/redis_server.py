"""A real redis-server for the tests, on 127.0.0.1 at a free port, nothing persisted;
skipped, with the reason, where redis-server is not installed (.ci/run installs it).
The server is bench's (`kvroute bench --cluster` starts the same one)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from bench.harness import processes
from bench.harness.processes import free_port


class RedisServer:
    """A redis-server on one port that a test may stop and start again (nothing kept
    in between)."""

    def __init__(self, workdir: Path, password: str | None = None) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed (Debian's redis-server package)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._workdir = workdir
        self._password = password
        self._running = ExitStack()

    def start(self) -> None:
        """Start it, and return once it accepts a connection (bounded)."""
        self._running.enter_context(
            processes.redis_server(self._workdir, self._password, self.port)
        )

    def stop(self) -> None:
        """Stop it, and wait for it to end."""
        self._running.close()


@contextmanager
def redis_server(
    workdir: Path, password: str | None = None, port: int | None = None
) -> Iterator[str]:
    """Its URL while it runs; stopped (and waited for) on the way out. `port`: the one
    it listens on (a restarted server where the last one was), else a free one."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian's redis-server package)")
    with processes.redis_server(workdir, password, port) as url:
        yield url
