"""vLLM KV cache events → the prefix index, one ZMQ subscription per backend.

Wire format (vllm-telemetry.md §2): PUB frames `[topic, seq (8-byte big-endian), payload]`,
payload msgpack `[ts, events, dp_rank]`; each event is a positional array `[tag, ...]`
(vLLM ≤0.23) or a map `{"type": tag, ...}` (≥0.24), so both are accepted, unknown fields
and tags ignored, absent or nil fields tolerated. Block hashes may be uint64 ints or raw
digests (bin): bins fold to their last 8 bytes big-endian, as llm-d does.

Sequence tracking: the next batch must carry `last + 1`. A gap is filled from the
replay socket (a DEALER sends `[b"", start_seq]`; replies `[b"", topic, seq, payload]`
(≥0.26) or `[b"", seq, payload]` (≤0.24), then an end marker with seq 0xFF*8); if replay
is unavailable or incomplete the backend's entries are cleared, since the index can no
longer be trusted. A sequence going back means the backend restarted: cleared too.

Each store and removal goes to its medium's index (hashing/tiered_index.py): the GPU's, a
configured offload tier's, or none (an unconfigured medium, counted). A token-less store is
an offloading connector's placeholder: an offload tier resolves it through the keys the
backend's other media hold; on the GPU it carries nothing to index.

Cost: a batch is decoded in one pass, and each run of its common events (GPU stores with
token ids and no LoRA, removals, hashes as ints) is applied in one call to the GPU table,
block keys hashed there (`PrefixIndex.events`); any other event goes the per-event way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from hashing.blocks import root_key
from hashing.tiered_index import TieredIndex
from router import log

END_OF_REPLAY = 2**64 - 1
_BLOCK_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
)
_REMOVED_FIELDS = ("block_hashes", "medium")
_REPLAY_TIMEOUT_S = 2.0
#: messages read from a socket at once before the loop turns to its other work
_DRAIN = 256
#: as a plain int: `int & zmq.POLLIN` makes an enum member (PollEvent's reflected `&`)
_POLLIN = int(zmq.POLLIN)
#: chain roots cached per applier (salts come from requests: bounded, cleared when full)
_MAX_ROOTS = 256


@dataclass
class EventStats:
    batches: int = 0
    gaps_replayed: int = 0
    resets: int = 0
    skipped: int = 0


def as_uint64(value: int | bytes) -> int:
    if isinstance(value, int):
        return value & 0xFFFFFFFFFFFFFFFF
    return int.from_bytes(bytes(value)[-8:], "big")


def _fields(event: Any, names: Sequence[str]) -> dict[str, Any] | None:
    """An event as a dict of the named fields, from either encoding; None if malformed."""
    if isinstance(event, dict):
        return event
    if isinstance(event, list) and event:
        return dict(zip(names, event[1:], strict=False))
    return None


def _tag(event: Any) -> str | None:
    if isinstance(event, dict):
        return event.get("type")
    if isinstance(event, list) and event and isinstance(event[0], str):
        return event[0]
    return None


def _salt(extra_keys: Any, lora_name: str | None) -> str | None:
    """cache_salt of block 0: the bare string among its extra keys that is not the LoRA."""
    if not extra_keys or not isinstance(extra_keys, list) or not extra_keys[0]:
        return None
    found = [k for k in extra_keys[0] if isinstance(k, str) and k != lora_name]
    return found[-1] if found else None


#: counts one batch's applied events: (stored, removed, cleared)
Tally = Callable[[int, int, int], None]
_Hash = int | bytes


class _Stored(msgspec.Struct, tag="BlockStored", gc=False):
    """BlockStored as vLLM >=0.24 sends it (a map); every field may be absent."""

    block_hashes: list[_Hash] | None = None
    parent_block_hash: _Hash | None = None
    token_ids: list[int] | None = None
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None


class _Removed(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[_Hash] | None = None
    medium: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _StoredArray(_Stored, array_like=True, gc=False):
    """The same as vLLM <=0.23 sends it: `[tag, field1, ...]` (trailing fields optional)."""


class _RemovedArray(_Removed, array_like=True, gc=False):
    pass


class _ClearedArray(_Cleared, array_like=True, gc=False):
    pass


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_StoredArray | _RemovedArray | _ClearedArray]


#: typed decoders, one per event form: one pass from bytes to structs
_DECODERS = (msgspec.msgpack.Decoder(_MapBatch), msgspec.msgpack.Decoder(_ArrayBatch))
#: the store and removal types the index's table applies in bulk (`PrefixIndex.events`)
_BULK_KINDS = ((_Stored, _StoredArray), (_Removed, _RemovedArray))


class EventApplier:
    """Applies decoded batches of one backend to the index (pure, no sockets); `tally`
    counts each batch's events (where the router counts them: alone, or the collector).

    A batch is decoded into typed structs in one pass, by the decoder of the form the
    backend sent last (the other next); one neither takes (an unknown tag, a field of an
    unexpected type) goes the tolerant way: generic msgpack, field by field."""

    def __init__(
        self,
        backend: str,
        index: TieredIndex,
        block_size: int,
        base_model: Callable[[], str],
        tally: Tally | None = None,
    ) -> None:
        self._backend = backend
        self._index = index
        self._block_size = block_size
        self._base_model = base_model
        self._tally = tally
        self._decoders = _DECODERS
        #: chain roots by (model or LoRA, salt): one hash per distinct pair, not per event
        self._roots: dict[tuple[str, str | None], int] = {}
        self.stats = EventStats()

    def apply_payloads(self, payloads: Sequence[bytes]) -> None:
        for payload in payloads:
            self.apply_payload(payload)

    def apply_payload(self, payload: bytes) -> None:
        batch = self._typed(payload)
        if batch is None:
            self._apply_generic(payload)
            return
        self._heard(batch.ts)
        counts = self._apply_events(batch.events)
        if self._tally is not None:
            self._tally(*counts)

    def _apply_events(self, events: list[Any]) -> list[int]:
        """A typed batch's events, in order: runs of the common ones (GPU stores with token
        ids, removals) in one call to the index's table each, the others here one by one.
        Its (stored, removed, cleared) counts."""
        counts = [0, 0, 0]
        backend, index, size = self._backend, self._index, self._block_size
        root = self._root(self._base_model(), None)
        at = 0
        while at < len(events):
            at, stored, removed, skipped = index.gpu.events(
                backend, events, at, size, root, _BULK_KINDS
            )
            counts[0] += stored + skipped
            counts[1] += removed
            self.stats.skipped += skipped
            if at < len(events):
                counts[self._apply_typed(events[at])] += 1
                at += 1
        return counts

    def _apply_typed(self, event: Any) -> int:
        """Apply one typed event; its kind (0 stored, 1 removed, 2 cleared)."""
        backend, index = self._backend, self._index
        kind = event.__class__
        if kind is _Removed or kind is _RemovedArray:
            hashes = [as_uint64(h) for h in event.block_hashes or ()]
            index.removed(backend, event.medium, hashes)
            return 1
        if kind is _Stored or kind is _StoredArray:
            parent = event.parent_block_hash
            lora = event.lora_name
            self._stored(
                event.token_ids, event.medium, event.block_hashes, event.block_size,
                lora, parent, event.extra_keys,
            )  # fmt: skip
            return 0
        index.cleared(backend)
        return 2

    def _typed(self, payload: bytes) -> _MapBatch | _ArrayBatch | None:
        """The batch as structs, by the form that decodes it (tried last first)."""
        for i, decoder in enumerate(self._decoders):
            try:
                batch = decoder.decode(payload)
            except msgspec.DecodeError:
                continue
            if i:
                self._decoders = self._decoders[::-1]
            return batch
        return None

    def _heard(self, ts: Any) -> None:
        self.stats.batches += 1
        self._index.trust.heard[self._backend] = time.monotonic()
        if isinstance(ts, float):
            self._index.published[self._backend] = ts

    def _apply_generic(self, payload: bytes) -> None:
        try:
            batch = msgspec.msgpack.decode(payload)
            events = batch[1]
        except (msgspec.DecodeError, TypeError, IndexError, KeyError):
            self.stats.skipped += 1
            return
        self._heard(batch[0])
        counts = [0, 0, 0]
        for event in events if isinstance(events, list) else ():
            kind = self._apply(event)
            if kind is not None:
                counts[kind] += 1
        if self._tally is not None:
            self._tally(*counts)

    def _apply(self, event: Any) -> int | None:
        """Apply one event; its kind (0 stored, 1 removed, 2 cleared), None if unknown."""
        tag = _tag(event)
        if tag == "BlockStored":
            f = _fields(event, _BLOCK_STORED_FIELDS) or {}
            self._stored(
                f.get("token_ids"), f.get("medium"), f.get("block_hashes"), f.get("block_size"),
                f.get("lora_name"), f.get("parent_block_hash"), f.get("extra_keys"),
            )  # fmt: skip
            return 0
        if tag == "BlockRemoved":
            fields = _fields(event, _REMOVED_FIELDS) or {}
            hashes = [as_uint64(h) for h in fields.get("block_hashes") or ()]
            self._index.removed(self._backend, fields.get("medium"), hashes)
            return 1
        if tag == "AllBlocksCleared":
            self._index.cleared(self._backend)
            return 2
        return None

    def _stored(
        self,
        tokens: Any,
        medium: Any,
        block_hashes: Any,
        block_size: Any,
        lora: Any,
        parent: Any,
        extra_keys: Any,
    ) -> None:
        hashes = [as_uint64(h) for h in block_hashes or ()]
        if not tokens:
            if not self._index.placed(self._backend, medium, hashes):
                self.stats.skipped += 1  # nothing known to resolve it by
            return
        if block_size != self._block_size:
            self.stats.skipped += 1
            return
        root = self._root(lora or self._base_model(), _salt(extra_keys, lora))
        parent_engine = None if parent is None else as_uint64(parent)
        bs = self._block_size
        try:
            stored = self._index.stored(
                self._backend, medium, parent_engine, hashes, tokens, bs, root
            )
        except ValueError:  # a token id outside uint32: nothing to hash it by
            stored = False
        if not stored:
            self.stats.skipped += 1

    def _root(self, model: str, salt: str | None) -> int:
        root = self._roots.get((model, salt))
        if root is None:
            if len(self._roots) >= _MAX_ROOTS:
                self._roots.clear()
            root = self._roots[(model, salt)] = root_key(model, salt)
        return root


class EventSubscriber:
    """One backend's SUB socket, sequence tracking and replay."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        applier: EventApplier,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        on_reset: Callable[[str], None],
    ) -> None:
        self._ctx = ctx
        self._applier = applier
        self._endpoint = endpoint
        self._replay = replay_endpoint
        self._topic = topic.encode()
        self._on_reset = on_reset
        self.last_seq: int | None = None

    async def run(self) -> None:
        """Read the batches as they come, in the socket's reader callback (`_Reading`),
        until a read fails (raised here: `run_forever` subscribes again)."""
        sub = zmq.Context.shadow(self._ctx.underlying).socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(self._endpoint)
        reading = _Reading(self, sub, asyncio.get_running_loop())
        try:
            await reading.failed
        finally:
            reading.stop()
            sub.close()

    def take(self, messages: Sequence[list[bytes]]) -> _Gap | None:
        """Apply batches in sequence; a restart, or a gap with no replay to fill it, resets
        first. The first gap a replay may fill is returned (for `filled`), with the
        messages from it on: order holds, so nothing after it is applied meanwhile."""
        run: list[bytes] = []
        last = self.last_seq
        for at, frames in enumerate(messages):
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            seq = int.from_bytes(frames[1], "big")
            if last is not None and not last < seq <= last + 1:
                self._apply_run(run, last)
                run = []
                if seq <= last:
                    self._reset("sequence went back (backend restarted)")
                elif self._replay:
                    return _Gap(last + 1, seq, messages[at:])
                else:
                    self._reset(f"unrecoverable gap {last + 1}..{seq - 1}")
            run.append(frames[2])
            last = seq
        self._apply_run(run, last)
        return None

    async def filled(self, gap: _Gap) -> _Gap | None:
        """The gap's batches from replay (a reset where they did not all come), then the
        messages after it, up to the next gap."""
        if not await self._fill(gap.start, gap.until):
            self._reset(f"unrecoverable gap {gap.start}..{gap.until - 1}")
        self.last_seq = gap.until - 1
        return self.take(gap.rest)

    def _apply_run(self, run: Sequence[bytes], last: int | None) -> None:
        """Apply batches in sequence, up to `last`: the sequence moves on once they are
        applied (were one to raise, the restarted subscription replays them)."""
        self._applier.apply_payloads(run)
        self.last_seq = last

    def _reset(self, why: str) -> None:
        self._applier.stats.resets += 1
        self._on_reset(why)

    async def _fill(self, start: int, until: int) -> bool:
        """Replay batches start..until-1; True when all of them arrived."""
        if not self._replay:
            return False
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay)
        expected = start
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(_REPLAY_TIMEOUT_S):
                while expected < until:
                    frames = await dealer.recv_multipart()
                    seq, payload = int.from_bytes(frames[-2], "big"), frames[-1]
                    if seq == END_OF_REPLAY:
                        break
                    if seq == expected:
                        self._applier.apply_payload(payload)
                        expected += 1
        except (TimeoutError, zmq.ZMQError, IndexError) as exc:
            log.backends.warning("KV event replay from %s failed: %s", self._replay, exc)
        finally:
            dealer.close()
        if expected >= until:
            self._applier.stats.gaps_replayed += 1
        return expected >= until


@dataclass(frozen=True, slots=True)
class _Gap:
    """Batches `start`..`until`-1 missed; `rest`: the messages from batch `until` on."""

    start: int
    until: int
    rest: Sequence[list[bytes]]


class _Reading:
    """One subscription's reads, in its socket's reader callback: what waits is applied
    before the loop moves on, with no task wake-up, future or exception a batch (at a
    thousand events a second per backend, pyzmq's asyncio reads were half the collector's
    time, and then a task woken by an asyncio.Event a tenth of it). A gap replay may fill
    is the one wait: the reads stop until it is filled, so batches stay in order."""

    def __init__(
        self, subscriber: EventSubscriber, sub: zmq.Socket, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._subscriber = subscriber
        self._sub = sub
        self._loop = loop
        self._fd = sub.getsockopt(zmq.FD)
        self._filling: asyncio.Task[None] | None = None
        self._later: asyncio.Handle | None = None
        #: set with the exception a read raised
        self.failed: asyncio.Future[None] = loop.create_future()
        loop.add_reader(self._fd, self.read)

    def read(self) -> None:
        """What waits on the socket, applied. ZMQ's descriptor only says the socket's
        state may have changed, once: `drain` ends on a read that finds nothing waiting,
        which rearms it."""
        if self.failed.done():
            return
        try:
            messages = drain(self._sub, _DRAIN)
            gap = self._subscriber.take(messages)
        except Exception as exc:  # the subscription starts again: see run_forever
            self.failed.set_exception(exc)
            return
        if gap is not None:
            self._loop.remove_reader(self._fd)
            self._filling = self._loop.create_task(self._fill_then_read(gap))
        elif len(messages) == _DRAIN:  # more may wait: the other backends' turn first
            self._later = self._loop.call_soon(self.read)

    async def _fill_then_read(self, gap: _Gap | None) -> None:
        try:
            while gap is not None:
                gap = await self._subscriber.filled(gap)
        except Exception as exc:
            if not self.failed.done():
                self.failed.set_exception(exc)
            return
        self._loop.add_reader(self._fd, self.read)
        self.read()  # what came meanwhile

    def stop(self) -> None:
        self._loop.remove_reader(self._fd)
        for pending in (self._filling, self._later):
            if pending is not None:
                pending.cancel()


def kv_context() -> zmq.asyncio.Context:
    """A ZMQ context for a socket per backend: libzmq's default stops at 1,023 sockets,
    short of a 1,024-backend fleet; its own limit (65,535) holds (file descriptors too:
    see `ulimit -n`)."""
    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT))
    return ctx


def drain(sock: zmq.Socket, limit: int) -> list[list[bytes]]:
    """Up to `limit` messages already queued on `sock` (a plain socket: no await each).
    A wake-up is for a message nearly always, so the first is read at once, and each
    next one once the socket's events say it waits: the events read that finds none,
    or the read that ends on `zmq.Again`, is what rearms ZMQ's descriptor. A message's
    frames are read as frames, each saying whether more follow (pyzmq makes an enum
    member for every option read: RCVMORE after each frame in `recv_multipart`). An
    events read costs half what a `zmq.Again` does (the exception): one a message, and
    one `zmq.Again` only when woken for none."""
    found: list[list[bytes]] = []
    try:
        while len(found) < limit:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
            parts = [frame.bytes]
            while frame.more:  # the rest of a message is there with its first frame
                frame = sock.recv(zmq.NOBLOCK, copy=False)
                parts.append(frame.bytes)
            found.append(parts)
            if not sock.get(zmq.EVENTS) & _POLLIN:
                break
    except zmq.Again:  # woken for no message
        pass
    return found


async def run_forever(subscriber: EventSubscriber, name: str) -> None:
    """Keep a subscription alive: log and retry after unexpected errors."""
    while True:
        try:
            await subscriber.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.backends.exception("KV event subscriber of %s failed; restarting", name)
        await asyncio.sleep(1.0)
