"""The collector's merged counted series and a worker's way to them
(router/control/metrics_relay.py), over a real Unix socket.

What is checked: a worker's client gets the page the server's `Metrics` makes, several
at once too (the server merges one at a time); a socket file a dead collector left is
replaced; with no collector to answer, /metrics fails with a 503 that says why and
when to try again, and the next scrape after the collector is back is answered.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from router.control.metrics_relay import CountedClient, CountedServer
from router.errors import MetricsUnavailable
from router.ingress.web import metrics_page
from router.metrics import Metrics


def counting() -> Metrics:
    metrics = Metrics(lambda: ())
    metrics.panic_routing.inc(3)
    return metrics


async def test_a_worker_gets_the_collectors_page_several_at_once(tmp_path: Path) -> None:
    path = str(tmp_path / "metrics.sock")
    (tmp_path / "metrics.sock").write_bytes(b"")  # a dead collector's socket file
    server, client = CountedServer(counting(), path), CountedClient(path)
    await server.start()
    try:
        pages = await asyncio.gather(*(client() for _ in range(4)))
        assert {p.count(b"\nkvroute_panic_routing_total 3.0\n") for p in pages} == {1}
    finally:
        await client.close()
        await server.stop()


async def test_with_no_collector_metrics_answers_503_and_then_recovers(tmp_path: Path) -> None:
    path = str(tmp_path / "metrics.sock")
    worker = Metrics(lambda: ())
    client = CountedClient(path, wait=5)
    worker.counted_elsewhere = client
    try:
        with pytest.raises(MetricsUnavailable):
            await client()
        answer = await metrics_page(worker)
        assert answer.status == 503 and answer.headers["Retry-After"] == "1"
        assert "collector" in orjson.loads(answer.body)["error"]["message"]
        server = CountedServer(counting(), path)
        await server.start()
        try:
            answer = await metrics_page(worker)
            assert answer.status == 200
            assert b"\nkvroute_panic_routing_total 3.0\n" in answer.body
            assert b"kvroute_build_info{" in answer.body  # the worker's own part
        finally:
            await server.stop()
    finally:
        await client.close()
