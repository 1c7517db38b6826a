"""Router replicas sharing one view through Redis (config `cluster.redis`).

Each replica of a router learns only its own placements and sees only its own requests in
flight; without KV events a prefix one replica placed is cold to the others. Through one
Redis server every replica hears the others':

- **placements** (backend, wall-clock expiry, the prompt's new block keys), published as
  the workers make them, batched per loop turn, and applied to every worker's prefix
  index as another worker's are (router/fleet/placements.py, feed topic `l`);
- **load**: the router's requests in flight and queued prompt tokens per backend, every
  `LOAD_INTERVAL_S`; each worker adds the others' sums to its backends (`remote_*`,
  feed topic `r`), and a replica silent for `PEER_TTL_S` drops out of them. A placement
  heard counts in its replica's load at once (a request, its new blocks' tokens), until
  that replica's next load message;
- **speeds**: each backend's speed as the replica learned it from its streams, with the
  samples behind it (router/fleet/speeds.py), every `SPEEDS_INTERVAL_S` (they change
  slowly); the others' are pooled per backend, weighted by samples, and sent to the
  workers (feed topic `v`), where a backend this replica has not learned yet takes them
  before the fleet's typical speed. A replica's own learned figure stands whole: it
  comes from enough samples already, timed on this replica's own path to the backend,
  and mixing in the others' would need no more than the cold start does. A replica
  silent for `SPEEDS_TTL_S` drops out of them.

Which process: the collector. It already hears every worker's placements (their
broadcast batches reach its control socket) and feeds every worker, so one replica holds
one Redis client (a connection to publish, one subscribed) however many workers it runs,
and no worker's event loop, so no request, ever waits on Redis. With `cluster` set,
`kvroute serve` runs a collector even for one worker.

Pub/sub, not streams: placements and load are hints that matter for seconds, and only to
replicas listening now; pub/sub delivers them in one hop with nothing stored or trimmed
per message. What a joining replica would miss, the recent placements, is kept in a
capped list with a TTL (`recent`, LPUSH + LTRIM in the same pipeline as the PUBLISH),
which it reads once it has subscribed, so it does not start cold; its workers get them
in their welcome.

Fail open: any Redis error (refused, reset, a reply slower than `timeout_s`) ends the
session; the replica routes alone (the others' load is dropped at once, their
placements age out of the index), says so once in the log and in
`kvroute_cluster_connected`, and reconnects with back-off. Placements made meanwhile are
not sent later.

Trust: every message is decoded into a Struct (`Placed`, `Load` or `Speeds`) with bounds; a
malformed one is counted (`kvroute_cluster_messages{outcome="malformed"}`) and dropped,
as is a foreign one (another block size, so other keys); backends this replica does not
have are skipped. `key_prefix` names the channel and the list, so routers sharing one
Redis never hear each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Annotated

import msgspec
from msgspec import Meta

from policies import Speed
from router import log
from router.config import ClusterConfig, ConfigError
from router.context import COLLECTOR, WorkerContext
from router.fleet.backends import Fleet
from router.fleet.placements import decode_learned, encode_learned
from router.fleet.shared_load import LoadTable
from router.fleet.speeds import SpeedLearner, pooled, speed_prior
from router.metrics import Metrics
from router.secrets import redis_password

#: how often a replica publishes its load
LOAD_INTERVAL_S = 0.1
#: a replica not heard from for this long is dropped from the load view
PEER_TTL_S = 1.5
#: how often a replica publishes its learned speeds, and how long the others' stand
SPEEDS_INTERVAL_S = 1.0
SPEEDS_TTL_S = 3 * SPEEDS_INTERVAL_S
#: reconnection back-off, first and longest
BACKOFF_S = (0.1, 5.0)
#: recent placement batches kept in Redis for joining replicas, and their list's TTL
HISTORY = 2000
HISTORY_TTL_S = 600
#: the most placements waiting to be published (a slow Redis loses the oldest hints)
OUTBOX = 10_000
#: a message larger than this is malformed (a batch of one turn is far smaller)
MAX_MESSAGE = 4 << 20

_Count = Annotated[int, Meta(ge=0, le=1 << 40)]
_Key = Annotated[int, Meta(ge=0)]  # msgpack holds no integer past 64 bits
_Name = Annotated[str, Meta(max_length=256)]
_Rate = Annotated[float, Meta(gt=0, le=1e12)]
_Seconds = Annotated[float, Meta(ge=0, le=3600)]


class Placed(msgspec.Struct, tag="placed", forbid_unknown_fields=True):
    """One replica's placements of one turn: (backend, expiry in epoch seconds, keys)."""

    router: _Name
    block: Annotated[int, Meta(ge=1)]
    placed: list[tuple[_Name, float, list[_Key]]]


class Load(msgspec.Struct, tag="load", forbid_unknown_fields=True):
    """One replica's load: per backend, requests in flight and queued prompt tokens."""

    router: _Name
    backends: dict[_Name, tuple[_Count, _Count]]


class Speeds(msgspec.Struct, tag="speeds", forbid_unknown_fields=True):
    """One replica's learned speeds: per backend, `Speed`'s figures and the samples
    they come from."""

    router: _Name
    backends: dict[_Name, tuple[_Rate, _Seconds, _Seconds, _Count]]


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Placed | Load | Speeds).decode
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


class OwnLoad:
    """This router's load and learned speeds per backend, read by the collector from
    the workers' shared load table (router/fleet/shared_load.py), which it never writes."""

    def __init__(self, fleet: Fleet, context: WorkerContext) -> None:
        self._fleet = fleet
        self._table = LoadTable(context.table_path, context.slots, context.workers, None)
        self._slots: dict[str, int] = {}

    def __call__(self) -> dict[str, tuple[int, int]]:
        table = self._table
        return {
            name: (table.inflight(slot), table.queued_tokens(slot)) for name, slot in self._found()
        }

    def speeds(self) -> dict[str, tuple[float, float, float, int]]:
        """Each backend's speed as the workers' samples show it (computed as a worker
        does), with their count; the backends still at the prior left out."""
        prior = speed_prior(self._fleet.policy.params)
        speeds: dict[str, tuple[float, float, float, int]] = {}
        if prior is None:
            return speeds
        for name, slot in self._found():
            samples = SpeedLearner(self._table, slot)
            learned = samples.learned(prior)
            if learned is not None:
                speeds[name] = (*learned, samples.counted())
        return speeds

    def _found(self) -> list[tuple[str, int]]:
        """(backend, slot) of the backends some worker counted a request at."""
        found = []
        for b in self._fleet.members:
            slot = self._slots.get(b.name)
            if slot is None:
                slot = self._table.find(b.name, str(b.url))
                if slot is None:
                    continue
                self._slots[b.name] = slot
            found.append((b.name, slot))
        return found

    def close(self) -> None:
        self._table.close()


class ClusterLink:
    """The collector's session with the cluster's Redis: publishes this replica's
    placements and load, applies the others' to the workers through `feed`."""

    def __init__(
        self,
        cfg: ClusterConfig,
        fleet: Fleet,
        metrics: Metrics,
        block: int,
        own_load: Callable[[], dict[str, tuple[int, int]]],
        own_speeds: Callable[[], dict[str, tuple[float, float, float, int]]],
    ) -> None:
        """ConfigError if the password cannot be read or redis-py is not installed."""
        try:
            import redis.asyncio
        except ImportError:
            need = "cluster: needs the redis extra: pip install 'kvroute[redis]'"
            raise ConfigError(need) from None
        self._redis = redis.asyncio
        self._cfg = cfg.redis
        self._password = redis_password(cfg.redis, "cluster.redis")
        self._fleet = fleet
        self._metrics = metrics
        self._block = block
        self._own_load = own_load
        self._own_speeds = own_speeds
        self.router = secrets.token_hex(8)  # this replica, in its messages
        self._channel = f"{cfg.redis.key_prefix}feed"
        self._recent = f"{cfg.redis.key_prefix}recent"
        self._feed: Callable[[list[bytes]], None] = lambda frames: None
        self._outbox: list[tuple[str, float, list[int]]] = []
        self._pending = asyncio.Event()
        self._peers: dict[str, tuple[float, dict[str, tuple[int, int]]]] = {}
        self._sent_load: bytes | None = None
        self._speeds: dict[str, tuple[float, dict[str, tuple[float, float, float, int]]]] = {}
        self._sent_speeds: bytes | None = None
        #: the others' batches as feed payloads, with their last expiry (for welcomes)
        self._history: deque[tuple[float, bytes]] = deque(maxlen=HISTORY)
        self.connected = False
        self._alone_said = False
        metrics.cluster_connected.set(0)

    def attach(self, feed: Callable[[list[bytes]], None]) -> None:
        """Where the others' placements (`l`) and load (`r`) go: the collector's feed."""
        self._feed = feed

    def placed(self, payload: bytes) -> None:
        """A worker's broadcast batch: queued for Redis, expiries made wall-clock."""
        if not self.connected:
            return
        _, placed, _ = decode_learned(payload)
        offset = time.time() - time.monotonic()
        self._outbox.extend((b, expires_at + offset, keys) for b, expires_at, keys in placed)
        del self._outbox[:-OUTBOX]
        self._pending.set()

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

    async def run(self) -> None:
        """Sessions with Redis until cancelled, with back-off between them. Whatever
        ends one (an error of Redis, of the network, or of this code) leaves the replica
        routing alone until the next."""
        wait = BACKOFF_S[0]
        while True:
            client = self._redis.Redis.from_url(
                self._cfg.url,
                password=self._password,
                socket_timeout=self._cfg.timeout_s,
                socket_connect_timeout=self._cfg.timeout_s,
            )
            shared = False  # the session got as far as sharing: back off from the start
            try:
                await self._session(client)
            except Exception as exc:
                shared = self.connected
                self._alone(exc)
            finally:
                with contextlib.suppress(Exception):
                    await client.aclose()
            if shared:
                wait = BACKOFF_S[0]
            await asyncio.sleep(wait)
            wait = min(wait * 2, BACKOFF_S[1])

    async def _session(self, client) -> None:
        """Subscribe, catch up on the recent placements, then publish and listen until
        an error ends it."""
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(self._channel)
            for message in reversed(await client.lrange(self._recent, 0, HISTORY - 1)):
                self._received(message, live=False)
            self._shared()
            tasks = [
                asyncio.create_task(self._listen(pubsub)),
                asyncio.create_task(self._publish_placements(client)),
                asyncio.create_task(self._publish_load(client)),
                asyncio.create_task(self._publish_speeds(client)),
            ]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            for task in done:
                task.result()
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    def _shared(self) -> None:
        self.connected = True
        self._metrics.cluster_connected.set(1)
        if self._alone_said:
            log.server.warning("cluster: Redis %s is back: sharing again", self._cfg.url)
        else:
            log.server.info("cluster: sharing through Redis %s", self._cfg.url)
        self._alone_said = False

    def _alone(self, exc: BaseException) -> None:
        """The session ended: route alone, said once until it is back."""
        was = self.connected
        self.connected = False
        self._metrics.cluster_connected.set(0)
        self._outbox.clear()
        if self._peers:
            self._peers.clear()
            self._metrics.cluster_peers.set(0)
            self._send_load()
        if self._speeds:
            self._speeds.clear()
            self._send_speeds()
        if was or not self._alone_said:
            log.server.warning(
                "cluster: Redis %s unreachable (%s): routing alone, reconnecting",
                self._cfg.url,
                exc or type(exc).__name__,
            )
            self._alone_said = True

    async def _listen(self, pubsub) -> None:
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None and message.get("type") == "message":
                self._received(message["data"])

    async def _publish_placements(self, client) -> None:
        """This turn's placements in one message, on the channel and in the list."""
        while True:
            await self._pending.wait()
            self._pending.clear()
            batch, self._outbox = self._outbox, []
            if not batch:
                continue
            data = _encode(Placed(self.router, self._block, batch))
            async with client.pipeline(transaction=False) as pipe:
                pipe.publish(self._channel, data)
                pipe.lpush(self._recent, data)
                pipe.ltrim(self._recent, 0, HISTORY - 1)
                pipe.expire(self._recent, HISTORY_TTL_S)
                await pipe.execute()

    async def _publish_load(self, client) -> None:
        """This replica's load every interval; the silent others dropped."""
        while True:
            await client.publish(self._channel, _encode(Load(self.router, self._own_load())))
            self._expire_peers()
            await asyncio.sleep(LOAD_INTERVAL_S)

    async def _publish_speeds(self, client) -> None:
        """This replica's learned speeds every interval; the silent others' dropped."""
        while True:
            speeds = Speeds(self.router, self._own_speeds())
            await client.publish(self._channel, _encode(speeds))
            cutoff = time.monotonic() - SPEEDS_TTL_S
            gone = [r for r, (seen, _) in self._speeds.items() if seen < cutoff]
            for router in gone:
                del self._speeds[router]
            if gone:
                self._send_speeds()
            await asyncio.sleep(SPEEDS_INTERVAL_S)

    def _received(self, data: bytes, live: bool = True) -> None:
        """One message from Redis, validated; never raises. `live`: from the channel,
        not the recent list."""
        try:
            if len(data) > MAX_MESSAGE:
                raise msgspec.ValidationError("too large")
            message = _decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError):
            self._metrics.cluster_messages.labels("malformed").inc()
            return
        if message.router == self.router:
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
            payload = encode_learned(COLLECTOR, placed)
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

    def _expire_peers(self) -> None:
        cutoff = time.monotonic() - PEER_TTL_S
        gone = [r for r, (seen, _) in self._peers.items() if seen < cutoff]
        for router in gone:
            del self._peers[router]
        if gone:
            self._metrics.cluster_peers.set(len(self._peers))
            self._send_load()

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
