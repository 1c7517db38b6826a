"""What reading KV event batches off a backend's socket costs the collector, per message.

Run: .venv/bin/pytest bench/micro/test_bench_kv_drain.py --benchmark-enable

A vLLM publisher sends a batch as three frames (topic, sequence, payload); at 1,000
events a second in batches every 20 ms, a collector of 256 backends reads ~12,800 of
them a second. Each round queues 64 messages on a PAIR socket over inproc and reads them
back: `recv_multipart` asking EVENTS before each message (the collector's reader until
2026-12: pyzmq makes an enum member for every option read, RCVMORE after each frame
too), against router/telemetry/kv_events.py's `drain`. Compare the ratios, not the
times.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import zmq

from router.telemetry.kv_events import drain

_MESSAGES = 64
_PAYLOAD = b"\x93" + b"x" * 299  # a few events' msgpack


def _asking(sock: zmq.Socket, limit: int) -> list[list[bytes]]:
    found: list[list[bytes]] = []
    while len(found) < limit and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        found.append(sock.recv_multipart(zmq.NOBLOCK))
    return found


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context()
    sender, reader = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    sender.bind("inproc://batches")
    reader.connect("inproc://batches")
    yield sender, reader
    sender.close(linger=0)
    reader.close(linger=0)
    ctx.term()


def _round(pair: tuple[zmq.Socket, zmq.Socket], read: Callable) -> int:
    sender, reader = pair
    for seq in range(_MESSAGES):
        sender.send_multipart([b"kv@b0", seq.to_bytes(8, "big"), _PAYLOAD])
    got = read(reader, _MESSAGES)
    assert len(got) == _MESSAGES and got[-1][2] == _PAYLOAD
    return len(got)


def test_baseline_asking_each_option(benchmark, pair) -> None:
    assert benchmark(_round, pair, _asking) == _MESSAGES


def test_drain_by_frames(benchmark, pair) -> None:
    assert benchmark(_round, pair, drain) == _MESSAGES
