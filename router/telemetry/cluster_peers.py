"""What a replica heard of the others through Redis (router/telemetry/cluster.py): their
placements, load and learned speeds, validated, kept while they stand, and handed to
the workers through the collector's feed when they change.

The feed's topics: `l` the others' placements (as another worker's), `r` their load
summed per backend, `v` their speeds pooled per backend. The workers take `r` and `v`
here too (`apply_remote_load`, `apply_shared_speeds`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import msgspec

from policies import Speed
from router.context import COLLECTOR
from router.fleet.backends import Fleet
from router.fleet.placements import Learned, encode_learned
from router.fleet.speeds import pooled
from router.metrics import Metrics
from router.telemetry.cluster_wire import HISTORY, PEER_TTL_S, SPEEDS_TTL_S, Load, Placed, Speeds
from router.telemetry.cluster_wire import decode as decode_message

_encode_loads = msgspec.msgpack.Encoder().encode
_decode_loads = msgspec.msgpack.Decoder(dict[str, tuple[int, int]]).decode
_decode_speeds = msgspec.msgpack.Decoder(dict[str, Speed]).decode


def apply_remote_load(fleet: Fleet, payload: bytes) -> None:
    """A worker takes the other replicas' load (feed topic `r`) into its backends."""
    loads = _decode_loads(payload)
    for b in fleet.members:
        b.remote_inflight, b.remote_queued = loads.get(b.name, (0, 0))


def apply_shared_speeds(fleet: Fleet, payload: bytes) -> None:
    """A worker takes the other replicas' learned speeds (feed topic `v`)."""
    speeds = _decode_speeds(payload)
    for b in fleet.members:
        b.shared_speed = speeds.get(b.name)
    fleet.lend_speeds()


def _drop_silent(heard: dict[str, tuple[float, object]], ttl: float) -> bool:
    """Drop from `heard` (replica: (last heard, what it said)) the replicas silent
    for `ttl` seconds; whether there were any."""
    cutoff = time.monotonic() - ttl
    gone = [r for r, (seen, _) in heard.items() if seen < cutoff]
    for router in gone:
        del heard[router]
    return bool(gone)


class Peers:
    """The other replicas as this one heard them; `router` names this one (its own
    messages come back on the channel and are skipped)."""

    def __init__(self, fleet: Fleet, metrics: Metrics, block: int, router: str) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self._block = block
        self._router = router
        self._feed: Callable[[list[bytes]], None] = lambda frames: None
        self._peers: dict[str, tuple[float, dict[str, tuple[int, int]]]] = {}
        self._sent_load: bytes | None = None
        self._speeds: dict[str, tuple[float, dict[str, tuple[float, float, float, int]]]] = {}
        self._sent_speeds: bytes | None = None
        #: the others' batches as feed payloads, with their last expiry (for welcomes)
        self._history: deque[tuple[float, bytes]] = deque(maxlen=HISTORY)

    def attach(self, feed: Callable[[list[bytes]], None]) -> None:
        """Where the others' placements (`l`), load (`r`) and speeds (`v`) go."""
        self._feed = feed

    def replay(self) -> list[tuple[bytes, bytes]]:
        """What a joining worker needs to hear, as (feed kind, payload): the others'
        placements still alive (`l`), then their load (`r`) and speeds (`v`)."""
        now = time.monotonic()
        frames = [(b"l", payload) for expires_at, payload in self._history if expires_at > now]
        if self._sent_load is not None:
            frames.append((b"r", self._sent_load))
        if self._sent_speeds is not None:
            frames.append((b"v", self._sent_speeds))
        return frames

    def received(self, data: bytes, live: bool = True) -> None:
        """One message from Redis, validated; never raises. `live`: from the channel,
        not the recent list."""
        try:
            message = decode_message(data)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError):
            self._metrics.cluster_messages.labels("malformed").inc()
            return
        if message.router == self._router:
            return
        if isinstance(message, Load):
            self._peers[message.router] = (time.monotonic(), message.backends)
            self._metrics.cluster_peers.set(len(self._peers))
            self._send_load()
        elif isinstance(message, Speeds):
            self._speeds[message.router] = (time.monotonic(), message.backends)
            self._send_speeds()
        elif message.block != self._block:
            self._metrics.cluster_messages.labels("foreign").inc()
            return
        else:
            self._learn(message, live)
        self._metrics.cluster_messages.labels("applied").inc()

    def _learn(self, message: Placed, live: bool) -> None:
        """Another replica's placements, to the workers as another worker's (`l`);
        `live`: just published (not read back from the recent list)."""
        offset = time.monotonic() - time.time()
        now = time.monotonic()
        known = {b.name for b in self._fleet.members}
        placed = [
            (backend, expires_at + offset, keys)
            for backend, expires_at, keys in message.placed
            if backend in known and expires_at + offset > now and keys
        ]
        if placed:
            payload = encode_learned(Learned(COLLECTOR, placed))
            self._history.append((max(p[1] for p in placed), payload))
            self._feed([b"l", b"", payload])
        if live and placed:
            self._queued(message.router, placed)

    def _queued(self, router: str, placed: list[tuple[str, float, list[int]]]) -> None:
        """Count another replica's placements in its load at once (a request, and its
        new blocks' tokens to prefill), rather than up to `LOAD_INTERVAL_S` later: its
        next load message, which counts them, replaces the guess. Replicas placing new
        prefixes at the same moment thus see each other's queues in milliseconds."""
        seen, backends = self._peers.get(router, (time.monotonic(), {}))
        backends = dict(backends)
        for backend, _, keys in placed:
            inflight, queued = backends.get(backend, (0, 0))
            backends[backend] = (inflight + 1, queued + len(keys) * self._block)
        self._peers[router] = (seen, backends)
        self._send_load()

    def expire_load(self) -> None:
        """The load of replicas silent for `PEER_TTL_S` dropped."""
        if _drop_silent(self._peers, PEER_TTL_S):
            self._metrics.cluster_peers.set(len(self._peers))
            self._send_load()

    def expire_speeds(self) -> None:
        """The speeds of replicas silent for `SPEEDS_TTL_S` dropped."""
        if _drop_silent(self._speeds, SPEEDS_TTL_S):
            self._send_speeds()

    def forget(self) -> None:
        """The session with Redis ended: the others' load and speeds dropped at once
        (their placements age out of the workers' indexes)."""
        if self._peers:
            self._peers.clear()
            self._metrics.cluster_peers.set(0)
            self._send_load()
        if self._speeds:
            self._speeds.clear()
            self._send_speeds()

    def _send_load(self) -> None:
        """The others' load summed per backend, to the workers when it changed."""
        total: dict[str, list[int]] = {}
        for _, backends in self._peers.values():
            for name, (inflight, queued) in backends.items():
                sums = total.setdefault(name, [0, 0])
                sums[0] += inflight
                sums[1] += queued
        payload = _encode_loads(total)
        if payload != self._sent_load:
            self._sent_load = payload
            self._feed([b"r", b"", payload])

    def _send_speeds(self) -> None:
        """The others' learned speeds pooled per backend (speeds.py `pooled`), to the
        workers when they changed."""
        figures: dict[str, list[tuple[Speed, int]]] = {}
        for _, backends in self._speeds.values():
            for name, (*speed, samples) in backends.items():
                figures.setdefault(name, []).append((Speed(*speed), samples))
        shared = {name: pooled(found) for name, found in figures.items()}
        payload = _encode_loads({name: s for name, s in shared.items() if s is not None})
        if payload != self._sent_speeds:
            self._sent_speeds = payload
            self._feed([b"v", b"", payload])
