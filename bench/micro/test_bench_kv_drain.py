"""What reading KV event batches off a backend's socket costs the collector, per wake-up.

Run: .venv/bin/pytest bench/micro/test_bench_kv_drain.py --benchmark-enable

A vLLM publisher sends a batch as three frames (topic, sequence, payload); at 1,000
events a second in batches every 20 ms, a collector of 256 backends reads ~12,800 of
them a second, each backend's socket waking it for one batch at a time unless the
collector falls behind. A round queues `n` messages on a PAIR socket over inproc and
reads them back as the subscriber's loop does on a wake-up, until the socket's
descriptor is rearmed:

- the baseline, the reader of early 2026-12: frames read until `zmq.Again`, then the
  loop's second read (another `zmq.Again`) and its read of the socket's events;
- router/telemetry/kv_events.py's `drain`, which reads the first message at once and each
  next one once the socket's events say it waits, ending on the events read that finds
  none.

Rounds of 1 message (a collector keeping up) and of 64 (one behind). Compare the
ratios, not the times.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import zmq

from router.telemetry.kv_events import drain

_PAYLOAD = b"\x93" + b"x" * 299  # a few events' msgpack


def _until_again(sock: zmq.Socket, limit: int) -> list[list[bytes]]:
    found: list[list[bytes]] = []
    with contextlib.suppress(zmq.Again):
        while len(found) < limit:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
            parts = [frame.bytes]
            while frame.more:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
                parts.append(frame.bytes)
            found.append(parts)
    return found


def _wake_before(sock: zmq.Socket, limit: int) -> list[list[bytes]]:
    found = _until_again(sock, limit)
    assert not _until_again(sock, limit)
    sock.getsockopt(zmq.EVENTS)
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


def _round(pair: tuple[zmq.Socket, zmq.Socket], read: Callable, n: int) -> int:
    sender, reader = pair
    for seq in range(n):
        sender.send_multipart([b"kv@b0", seq.to_bytes(8, "big"), _PAYLOAD])
    got = read(reader, 256)
    assert len(got) == n and got[-1][2] == _PAYLOAD
    return len(got)


@pytest.mark.parametrize("n", [1, 64])
def test_baseline_frames_until_again(benchmark, pair, n) -> None:
    assert benchmark(_round, pair, _wake_before, n) == n


@pytest.mark.parametrize("n", [1, 64])
def test_drain_reading_on_while_events_say_one_waits(benchmark, pair, n) -> None:
    assert benchmark(_round, pair, drain, n) == n
