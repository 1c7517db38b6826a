"""KV event publisher of one backend: vLLM's ZmqEventPublisher wire protocol over ZMQ.

PUB socket (an XPUB, so it sees subscriptions arrive: `subscribed` is set once a
subscriber's filter for the topic is in place, the moment from which no batch is lost to
it): one message per batch, frames `[topic, seq (8-byte big-endian), payload]`.
`seq` starts at 0 and grows by one per batch; `reset()` (a simulated restart) sets it
back to 0 and empties the replay ring, as a new vLLM process would.
Replay ROUTER socket (vLLM >=0.26 layout): a request `[identity, b"", start_seq]` gets
one reply `[identity, b"", topic, seq, payload]` per buffered batch with seq >= start_seq,
in order, then the end marker `[identity, b"", b"", 0xFF*8, b""]`. Malformed requests are
ignored. The ring keeps the last `buffer_steps` batches. PUB drops silently past `hwm`.
Both sockets bind on the backend's host only.
"""

import asyncio
import contextlib
import time
from collections import deque

import zmq
import zmq.asyncio

from bench.sim.kv_events import Encoding, KVEvent, encode_batch

END_OF_REPLAY = b"\xff" * 8


class KVEventPublisher:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        host: str,
        pub_port: int,
        replay_port: int,
        topic: str,
        encoding: Encoding,
        buffer_steps: int,
        hwm: int,
    ) -> None:
        self.topic = topic
        self._topic = topic.encode()
        self._encoding: Encoding = encoding
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self.subscribed = asyncio.Event()
        self._pub = ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # vLLM >=0.31
        for sock in (self._pub, self._router):
            sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind(self._pub, host, pub_port)
        self.replay_endpoint = _bind(self._router, host, replay_port)
        self._tasks = [
            asyncio.create_task(self._serve_replay()),
            asyncio.create_task(self._watch_subscriptions()),
        ]

    async def publish(self, events: list[KVEvent]) -> None:
        """Send one batch (one engine step's events) and keep it for replay."""
        seq = self._seq
        self._seq += 1
        payload = encode_batch(time.time(), events, self._encoding)
        self._ring.append((seq, payload))
        await self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    def reset(self) -> None:
        self._seq = 0
        self._ring.clear()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pub.close()
        self._router.close()

    async def _watch_subscriptions(self) -> None:
        """Set `subscribed` on the first subscription that matches the topic."""
        while True:
            frame = await self._pub.recv()
            if frame[:1] == b"\x01" and self._topic.startswith(frame[1:]):
                self.subscribed.set()

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._ring):
                if seq >= start:
                    reply = (identity, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    await self._router.send_multipart(reply)
            await self._router.send_multipart((identity, b"", b"", END_OF_REPLAY, b""))


def _bind(sock: zmq.asyncio.Socket, host: str, port: int) -> str:
    sock.bind(f"tcp://{host}:{port or '*'}")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
