"""EventApplier on hand-made payloads: both encodings, unknown fields and tags, hash forms."""

from __future__ import annotations

import random
import resource
from collections.abc import Callable

import msgspec
import pytest
import zmq
from hashing._block_table import HASHES_STORES

from hashing.blocks import chain, root_key
from hashing.tiered_index import Tier, TieredIndex
from router.telemetry.kv_events import EventApplier, as_uint64, drain, kv_context

MODEL = "m"
IDS = list(range(32))
KEYS = chain(root_key(MODEL, None), IDS, 16)


def apply(*events) -> tuple[TieredIndex, EventApplier]:
    index = TieredIndex()
    applier = EventApplier("pod", index, 16, lambda: MODEL)
    applier.apply_payload(msgspec.msgpack.encode([1.0, list(events), 0]))
    return index, applier


def stored_map(**extra) -> dict:
    event = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": IDS,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return {**event, **extra}


@pytest.mark.parametrize(
    ("events", "held"),
    [
        pytest.param([stored_map()], 2, id="map"),
        pytest.param(
            [["BlockStored", [1, 2], None, IDS, 16, None, "GPU", None, None, None, "x", None]],
            2,
            id="array-with-trailing-fields",
        ),
        pytest.param([stored_map(locality="LOCAL", future_field=[1])], 2, id="unknown-fields"),
        pytest.param([{"type": "BlockTeleported", "x": 1}, stored_map()], 2, id="unknown-tag"),
        pytest.param([stored_map(medium="cpu")], 0, id="cpu-tier-not-on-the-gpu"),
        pytest.param([stored_map(block_size=32)], 0, id="other-block-size"),
        pytest.param([stored_map(token_ids=[], block_size=0)], 0, id="token-less-placeholder"),
        pytest.param(
            [stored_map(), {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}],
            1,
            id="removed",
        ),
        pytest.param([stored_map(), ["AllBlocksCleared"]], 0, id="cleared"),
        pytest.param(["garbage", 7, None, stored_map()], 2, id="malformed-events-skipped"),
    ],
)
def test_events(events: list, held: int) -> None:
    index, _ = apply(*events)
    assert index.gpu.longest_prefix(KEYS, "pod") == held


def test_undecodable_payload_is_counted_not_raised() -> None:
    index = TieredIndex()
    applier = EventApplier("pod", index, 16, lambda: MODEL)
    applier.apply_payload(b"\xc1 not msgpack")
    assert applier.stats.skipped == 1


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(5, 5, id="int"),
        pytest.param(2**64 - 1, 2**64 - 1, id="uint64-max"),
        pytest.param(bytes(24) + (7).to_bytes(8, "big"), 7, id="sha256-bin-last-8-bytes"),
    ],
)
def test_hash_forms(value, expected: int) -> None:
    assert as_uint64(value) == expected


def test_offload_events_go_to_their_tier_and_unknown_media_are_counted() -> None:
    index = TieredIndex(tiers=(Tier("cpu", 1e-6),))
    applier = EventApplier("pod", index, 16, lambda: MODEL)
    placeholder = stored_map(block_hashes=[2], token_ids=[], block_size=0, medium="CPU")
    events = [
        stored_map(),
        placeholder,  # the tail block offloaded, as vLLM's offloading connector says it
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"},
        stored_map(medium="LocalDiskBackend"),
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "LocalDiskBackend"},
    ]
    applier.apply_payload(msgspec.msgpack.encode([1.0, events, 0]))
    assert index.gpu.longest_prefix(KEYS, "pod") == 1
    assert index.tier_blocks(KEYS, "pod", 1, index.reach()) == (2,)
    assert index.ignored == {"localdiskbackend": 2}
    assert applier.stats.skipped == 1  # the store on the unknown medium


def _appender(into: list[tuple[int, ...]]) -> Callable[..., None]:
    return lambda *counts: into.append(counts)


@pytest.mark.parametrize("form", ["map", "array"])
def test_typed_and_tolerant_paths_build_the_same_index(form: str) -> None:
    """The typed one-pass decoder and the generic one (taken for an unknown tag) agree,
    and each batch's events are counted by kind, with the batch's publish time kept."""
    stored = stored_map()
    removed = {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}
    if form == "array":
        stored = ["BlockStored", [1, 2], None, IDS, 16, None, "GPU", None]
        removed = ["BlockRemoved", [2], "GPU"]
    unknown = {"type": "BlockTeleported"} if form == "map" else ["BlockTeleported"]
    results = []
    for events in ([stored, removed], [stored, removed, unknown]):
        counted: list[tuple[int, int, int]] = []
        index = TieredIndex()
        applier = EventApplier("pod", index, 16, lambda: MODEL, _appender(counted))
        applier.apply_payload(msgspec.msgpack.encode([12.5, events, 0]))
        results.append(index.gpu.snapshot("pod"))
        applier.apply_payload(msgspec.msgpack.encode([13.5, [["AllBlocksCleared"]], 0]))
        assert counted == [(1, 1, 0), (0, 0, 1)]
        assert index.published == {"pod": 13.5}
        assert index.gpu.snapshot("pod") == []
    assert results[0] == results[1] == [(KEYS[0], 1)]


def test_typed_path_holds_what_the_events_say() -> None:
    """A store then a removal of its second block, through the typed decoder."""
    index, _ = apply(stored_map(), {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"})
    assert index.gpu.snapshot("pod") == [(KEYS[0], 1)]


def test_a_token_id_outside_uint32_skips_its_store_not_the_batch() -> None:
    """Such a store cannot be hashed: it is skipped, and the batch's other events apply
    (it raised out of the applier, so a worker's feed loop stopped on it)."""
    bad = stored_map(token_ids=[-1] * 16, block_hashes=[9])
    index, applier = apply(bad, stored_map())
    assert applier.stats.skipped == 1
    assert index.gpu.snapshot("pod") == [(KEYS[0], 1), (KEYS[1], 2)]


def test_the_telemetry_context_holds_a_socket_per_backend_of_a_large_fleet() -> None:
    """libzmq's default context refuses its 1,024th socket: a 1,100-backend fleet's
    subscriptions (and the collector's own sockets) must all open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2_048:
        pytest.skip(f"1,100 sockets need more file descriptors than the hard limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2_048), hard))
    ctx = kv_context()
    sockets = []
    try:
        for _ in range(1_100):
            sockets.append(ctx.socket(zmq.SUB))
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(sockets) == 1_100


def _random_batches(rng, batches: int) -> list[list]:
    """Batches as vLLM sends them, mixing what the table applies in bulk (GPU stores
    chained to a parent or not, removals) with what it leaves to Python (LoRA stores,
    hashes as bytes, an offload tier's, clears) and what both skip (another block size,
    an unknown parent, a token id past uint32)."""
    out, engine = [], 1

    def store(parent, blocks: int, **extra) -> dict:
        nonlocal engine
        hashes = list(range(engine, engine + blocks))
        engine += blocks
        ids = [rng.randrange(50_000) for _ in range(16 * blocks + rng.randrange(16))]
        return stored_map(block_hashes=hashes, parent_block_hash=parent, token_ids=ids, **extra)

    for _ in range(batches):
        events = []
        for _ in range(rng.randrange(1, 12)):
            known = rng.randrange(1, engine) if engine > 1 else None
            roll = rng.random()
            if roll < 0.45:
                events.append(store(rng.choice([None, known]), rng.randrange(1, 5)))
            elif roll < 0.7 and known:
                hashes = [rng.randrange(1, engine) for _ in range(rng.randrange(1, 4))]
                events.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"})
            elif roll < 0.75:
                events.append(store(known, 2, lora_name="adapter"))
            elif roll < 0.8 and known:
                removal = [known.to_bytes(8, "big")]
                events.append({"type": "BlockRemoved", "block_hashes": removal, "medium": None})
            elif roll < 0.85:
                events.append(store(None, 1, medium="cpu"))
            elif roll < 0.9:
                events.append(store(10**9, 1))  # a parent never stored
            elif roll < 0.93:
                events.append(store(None, 1, block_size=32))
            elif roll < 0.96:
                events.append(stored_map(block_hashes=[engine], token_ids=[2**32] * 16))
                engine += 1
            else:
                events.append({"type": "AllBlocksCleared"})
        out.append(events)
    return out


def test_a_batch_applied_in_bulk_is_the_batch_applied_event_by_event() -> None:
    """The same random batches through the applier (runs of common events in one call to
    the table) and one event at a time through its per-event path: the same index, the
    same counts, the same skips."""
    rng = random.Random(7)
    tiers = [Tier("cpu", 1e-6)]
    bulk, one_by_one = TieredIndex(tiers=tiers), TieredIndex(tiers=tiers)
    counted: list[tuple[int, int, int]] = []
    applier = EventApplier("pod", bulk, 16, lambda: MODEL, _appender(counted))
    reference = EventApplier("pod", one_by_one, 16, lambda: MODEL)
    expected, peak = [0, 0, 0], 0
    for events in _random_batches(rng, 300):
        payload = msgspec.msgpack.encode([1.0, events, 0])
        applier.apply_payload(payload)
        for event in reference._typed(payload).events:
            expected[reference._apply_typed(event)] += 1
        for medium in ("gpu", "cpu"):
            mine, theirs = bulk.index_of(medium), one_by_one.index_of(medium)
            assert mine.snapshot("pod") == theirs.snapshot("pod")
        peak = max(peak, bulk.gpu.size("pod")[0])
    assert [sum(c[i] for c in counted) for i in range(3)] == expected
    assert applier.stats.skipped == reference.stats.skipped > 0
    assert bulk.gpu.orphans == one_by_one.gpu.orphans > 0
    assert peak > 50 and expected[2] > 0


def test_the_table_hashes_the_stores_itself() -> None:
    """The xxhash package exports the hash the block keys use, and the table found it:
    without it every store would go the per-event Python way (a wheel that stopped
    exporting it would fail here, not slow the collector unseen)."""
    assert HASHES_STORES


def test_drain_takes_whole_messages_up_to_its_limit_and_stops_when_none_wait() -> None:
    ctx = zmq.Context()
    sender, reader = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        port = sender.bind_to_random_port("tcp://127.0.0.1")
        reader.connect(f"tcp://127.0.0.1:{port}")
        assert drain(reader, 10) == []
        sent = [[b"kv@b0", i.to_bytes(8, "big"), b"x" * i] for i in range(5)] + [[b"one"]]
        for frames in sent:
            sender.send_multipart(frames)
        assert reader.poll(10_000) == zmq.POLLIN  # the first has arrived
        got: list[list[bytes]] = []
        for _ in range(1000):  # each at most 4, until all six are in
            taken = drain(reader, 4)
            assert len(taken) <= 4
            got += taken
            if len(got) == len(sent):
                break
            reader.poll(1000)
        assert got == sent
        assert drain(reader, 4) == []
    finally:
        sender.close(linger=0)
        reader.close(linger=0)
        ctx.term()
