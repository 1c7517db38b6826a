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

Here: the session with Redis and what it publishes. The messages and their cadence are
in cluster_wire.py; what a replica heard of the others, in cluster_peers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable

from router import log
from router.config import ClusterConfig, ConfigError
from router.context import WorkerContext
from router.fleet.backends import Fleet
from router.fleet.placements import decode_learned
from router.fleet.shared_load import LoadTable
from router.fleet.speeds import SpeedLearner, speed_prior
from router.metrics import Metrics
from router.secrets import redis_password
from router.telemetry.cluster_peers import Peers
from router.telemetry.cluster_wire import (
    HISTORY,
    LOAD_INTERVAL_S,
    SPEEDS_INTERVAL_S,
    Load,
    Placed,
    Speeds,
    encode,
)

#: reconnection back-off, first and longest
BACKOFF_S = (0.1, 5.0)
#: the TTL of the recent placements' list in Redis
HISTORY_TTL_S = 600
#: the most placements waiting to be published (a slow Redis loses the oldest hints)
OUTBOX = 10_000


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


class Outbox:
    """This replica's placements waiting for Redis: queued as the workers make them,
    published once per loop turn, on the channel and in the recent list."""

    def __init__(self, router: str, block: int) -> None:
        self._router = router
        self._block = block
        self._queue: list[tuple[str, float, list[int]]] = []
        self._pending = asyncio.Event()

    def add(self, payload: bytes) -> None:
        """A worker's broadcast batch, its expiries made wall-clock."""
        placed = decode_learned(payload).placed
        offset = time.time() - time.monotonic()
        self._queue.extend((b, expires_at + offset, keys) for b, expires_at, keys in placed)
        del self._queue[:-OUTBOX]
        self._pending.set()

    def clear(self) -> None:
        self._queue.clear()

    async def publish(self, client, channel: str, recent: str) -> None:
        """This turn's placements in one message, on `channel` and in the `recent` list."""
        while True:
            await self._pending.wait()
            self._pending.clear()
            batch, self._queue = self._queue, []
            if not batch:
                continue
            data = encode(Placed(self._router, self._block, batch))
            async with client.pipeline(transaction=False) as pipe:
                pipe.publish(channel, data)
                pipe.lpush(recent, data)
                pipe.ltrim(recent, 0, HISTORY - 1)
                pipe.expire(recent, HISTORY_TTL_S)
                await pipe.execute()


class ClusterLink:
    """The collector's session with the cluster's Redis: publishes this replica's
    placements, load and speeds, and hands what it hears of the others to `peers`."""

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
        self._metrics = metrics
        self._own_load = own_load
        self._own_speeds = own_speeds
        self.router = secrets.token_hex(8)  # this replica, in its messages
        self.peers = Peers(fleet, metrics, block, self.router)
        self._channel = f"{cfg.redis.key_prefix}feed"
        self._recent = f"{cfg.redis.key_prefix}recent"
        self._outbox = Outbox(self.router, block)
        self.connected = False
        self._alone_said = False
        metrics.cluster_connected.set(0)

    def attach(self, feed: Callable[[list[bytes]], None]) -> None:
        """Where the others' placements, load and speeds go: the collector's feed."""
        self.peers.attach(feed)

    def placed(self, payload: bytes) -> None:
        """A worker's broadcast batch, queued for Redis while the session shares."""
        if self.connected:
            self._outbox.add(payload)

    def replay(self) -> list[tuple[bytes, bytes]]:
        """What a joining worker needs to hear, as (feed kind, payload): the others'
        placements still alive (`l`), then their load (`r`) and speeds (`v`)."""
        return self.peers.replay()

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
                self.peers.received(message, live=False)
            self._shared()
            tasks = [
                asyncio.create_task(self._listen(pubsub)),
                asyncio.create_task(self._outbox.publish(client, self._channel, self._recent)),
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
        self.peers.forget()
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
                self.peers.received(message["data"])

    async def _publish_load(self, client) -> None:
        """This replica's load every interval; the silent others dropped."""
        while True:
            await client.publish(self._channel, encode(Load(self.router, self._own_load())))
            self.peers.expire_load()
            await asyncio.sleep(LOAD_INTERVAL_S)

    async def _publish_speeds(self, client) -> None:
        """This replica's learned speeds every interval; the silent others' dropped."""
        while True:
            speeds = Speeds(self.router, self._own_speeds())
            await client.publish(self._channel, encode(speeds))
            self.peers.expire_speeds()
            await asyncio.sleep(SPEEDS_INTERVAL_S)
