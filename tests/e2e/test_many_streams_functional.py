"""10,000 concurrent streaming clients held open through `kvroute serve --workers 2`.

Three processes on 127.0.0.1: the raw instant backend; the router with two
workers (each holds a client and a backend socket per stream, so 10,000 streams need two
processes under a 20,000 descriptor limit); and this test's client, 10,000 bare asyncio
connections (bench.studies.streams). The backend sends each stream its first event at once and
the rest, one per half second like a slow decode loop, only once all 10,000 have opened
(`--slow-hold`): a router that could not hold them all at once would never see the rest.
Every stream must get every event and `[DONE]`.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import orjson
import pytest
import yaml

from bench.harness.processes import free_port, process, wait_ready
from bench.studies.instant_backend import SLOW_MODEL
from bench.studies.streams import Board, open_streams

STREAMS = 10_000
EVENTS = 8  # one at once, the other 7 one per INTERVAL once all streams are open
INTERVAL = 0.5
#: descriptors this process needs: a socket per stream, and some slack
FDS_NEEDED = STREAMS + 500

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        resource.getrlimit(resource.RLIMIT_NOFILE)[0] < FDS_NEEDED,
        reason=f"needs RLIMIT_NOFILE >= {FDS_NEEDED} for {STREAMS} client sockets",
    ),
]


def _config(tmp_path, backend: str) -> tuple[str, str]:
    port = free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "backends": [{"url": backend}],
        "routing": {"strategy": "ROUND_ROBIN"},
        "shutdown": {"drain_seconds": 1},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path), f"http://127.0.0.1:{port}"


async def test_ten_thousand_streams_are_held_open_and_each_gets_every_event(tmp_path) -> None:
    py = sys.executable
    backend_cmd = [py, "-m", "bench.studies.instant_backend", "--raw", "--port", "0"]
    body = orjson.dumps(
        {
            "model": SLOW_MODEL,
            "messages": [{"role": "user", "content": "hold on"}],
            "stream": True,
            "max_tokens": EVENTS,
        }
    )
    backend_cmd += ["--slow-interval", str(INTERVAL), "--slow-hold", str(STREAMS)]
    with process(backend_cmd) as backend:
        path, url = _config(tmp_path, backend.stdout.readline().strip())
        serve = [py, "-m", "router", "serve", "-c", path, "--workers", "2"]
        with process([*serve, "--log-level", "warning"]):
            await wait_ready(url, timeout=60)
            board = Board()
            t0 = time.monotonic()
            streams = await open_streams(url, STREAMS, body, board, timeout=90)
            opened = time.monotonic() - t0
            assert board.errors[:5] == []  # else the backend's --slow-hold never lets go
            await board.wait_closed(30)
            finished = time.monotonic() - t0

    print(
        f"\n{STREAMS} streams through 2 workers: all answering after {opened:.1f} s, "
        f"all done after {finished:.1f} s, peak {board.peak} open at once, "
        f"{board.events} events (cpus={os.cpu_count()})"
    )
    assert board.errors[:5] == []
    assert board.peak == STREAMS
    short = [s.events for s in streams if not (s.done and s.events == EVENTS + 1)]
    assert short == []  # EVENTS events and [DONE] each
    assert board.events == STREAMS * (EVENTS + 1)
