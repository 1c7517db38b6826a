"""PrefixIndex, block keys and the ChatML4 key cache: table-driven cases."""

from __future__ import annotations

import gc
import random
from collections import OrderedDict
from pathlib import Path

import msgspec
import pytest

from hashing.blocks import chain, root_key
from hashing.chat_tokens import BlockKeyCache, ChatML4, PromptBlocks, tokenize
from hashing.prefix_index import PrefixIndex

ROOT = root_key("m", None)
IDS = list(range(64))  # four blocks of 16


def test_root_isolates_model_and_salt() -> None:
    roots = {root_key("m", None), root_key("m", "a"), root_key("n", None), root_key("m", "")}
    assert len(roots) == 4


@pytest.mark.parametrize(
    ("ids", "blocks"),
    [
        pytest.param(list(range(15)), 0, id="partial-block-ignored"),
        pytest.param(list(range(16)), 1, id="one-block"),
        pytest.param(list(range(40)), 2, id="trailing-partial"),
    ],
)
def test_chain_keys_full_blocks_only(ids: list[int], blocks: int) -> None:
    assert len(chain(ROOT, ids, 16)) == blocks


def test_chain_is_prefix_stable() -> None:
    assert chain(ROOT, IDS, 16)[:2] == chain(ROOT, IDS[:32] + [999] * 32, 16)[:2]
    assert chain(ROOT, IDS, 16)[2] != chain(ROOT, IDS[:32] + [999] * 32, 16)[2]
    # continuing from a block key gives the same keys as one chain
    head = chain(ROOT, IDS[:32], 16)
    assert head + chain(head[-1], IDS[32:], 16) == chain(ROOT, IDS, 16)


def stored(index: PrefixIndex, backend: str = "a", ids=IDS, parent=None, hashes=None) -> bool:
    hashes = hashes if hashes is not None else [1000 + i for i in range(len(ids) // 16)]
    return index.stored(backend, parent, hashes, ids, 16, ROOT)


def test_store_lookup_remove_clear() -> None:
    index = PrefixIndex()
    keys = chain(ROOT, IDS, 16)
    assert stored(index)
    assert index.longest_prefix(keys, "a") == 4
    assert index.longest_prefix(keys, "b") == 0
    index.removed("a", [1003])  # the tail block evicted
    assert index.longest_prefix(keys, "a") == 3
    index.cleared("a")
    assert index.longest_prefix(keys, "a") == 0


def test_a_removal_also_drops_the_routers_own_guess_of_that_block() -> None:
    index = PrefixIndex()
    keys = chain(ROOT, IDS, 16)
    index.learn("a", keys, expires_at=float("inf"))  # routed there: speculative
    assert stored(index)  # then confirmed by the backend's events
    index.removed("a", [1002, 1003])
    assert index.longest_prefix(keys, "a") == 2
    assert index.size("a") == (2, 2)
    assert index.holders(keys[2:], 4) == []


def test_store_continues_from_a_known_parent_and_skips_orphans() -> None:
    index = PrefixIndex()
    keys = chain(ROOT, IDS, 16)
    assert stored(index, ids=IDS[:32], hashes=[1, 2])
    assert stored(index, ids=IDS[32:], parent=2, hashes=[3, 4])
    assert index.longest_prefix(keys, "a") == 4
    assert not stored(index, ids=IDS[32:], parent=77, hashes=[5, 6])
    assert index.orphans == 1


def test_capacity_evicts_least_recent() -> None:
    index = PrefixIndex(capacity=3)
    stored(index)
    assert index.size("a") == (3, 0)


def test_a_restored_snapshot_answers_and_evicts_as_the_original() -> None:
    """A late worker starts from the collector's snapshot: same lookups, same engine
    hashes for BlockRemoved, same LRU order, through a msgpack round trip."""
    original = PrefixIndex()
    keys = chain(ROOT, IDS, 16)
    stored(original)
    late = PrefixIndex(capacity=3)
    late.learn("a", keys[:1], expires_at=10.0)  # its own decisions stay
    late.restore("a", msgspec.msgpack.decode(msgspec.msgpack.encode(original.snapshot("a"))))
    assert late.size("a") == (3, 1)  # trimmed to its capacity, least recent first
    assert late.snapshot("a") == original.snapshot("a")[1:]
    whole = PrefixIndex()
    whole.restore("a", original.snapshot("a"))
    assert whole.longest_prefix(keys, "a") == 4
    whole.removed("a", [1003])
    assert whole.longest_prefix(keys, "a") == 3
    assert PrefixIndex().snapshot("nobody") == []


def test_speculative_keys_expire() -> None:
    index = PrefixIndex()
    keys = chain(ROOT, IDS, 16)
    index.learn("a", keys[:2], expires_at=10.0)
    assert index.longest_prefix(keys, "a") == 2
    index.expire(now=5.0)
    assert index.longest_prefix(keys, "a") == 2
    index.expire(now=11.0)
    assert index.longest_prefix(keys, "a") == 0


def test_key_cache_matches_uncached_chain() -> None:
    tok = ChatML4()
    cache = BlockKeyCache(tok, 16, checkpoint_blocks=2)
    doc = "x" * 1000
    for question in ("first", "second, longer question", "first"):
        text = doc + question
        keys, tokens = cache.keys(ROOT, text, 10_000)
        assert keys == chain(ROOT, tokenize(text), 16)
        assert tokens == len(tokenize(text))


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param("p" * 200, id="text"),
        pytest.param(list(range(50)), id="ids"),
        pytest.param([list(range(50)), [1, 2]], id="id-batch"),
        pytest.param(["p" * 200, "q"], id="text-batch"),
    ],
)
def test_prompt_blocks_forms(prompt) -> None:
    keys, tokens = PromptBlocks(16, 100).prompt("m", None, prompt)
    assert tokens == 50 and len(keys) == 3


KEYS = chain(ROOT, list(range(160)), 16)  # ten blocks


def _indexed(depths: dict[str, int]) -> PrefixIndex:
    index = PrefixIndex()
    for backend, blocks in depths.items():
        index.learn(backend, KEYS[:blocks], expires_at=10.0)
    return index


@pytest.mark.parametrize(
    ("depths", "limit", "expected"),
    [
        pytest.param({}, 4, set(), id="nobody"),
        pytest.param({"a": 3, "b": 10, "c": 7}, 4, {("a", 3), ("b", 10), ("c", 7)}, id="all"),
        pytest.param(
            {"a": 2, "b": 2, "c": 2, "d": 6, "e": 9},
            2,
            {("d", 6), ("e", 9)},
            id="the-longest-within-limit",
        ),
        pytest.param(
            {"a": 2, "b": 5, "c": 5, "d": 5, "e": 9},
            2,
            {("e", 9)},
            id="a-level-over-the-limit-left-out",
        ),
    ],
)
def test_holders_of_the_longest_prefixes(depths, limit, expected) -> None:
    index = _indexed(depths)
    assert set(index.holders(KEYS, limit)) == expected


def test_holders_that_tie_on_the_longest_prefix_are_cut_to_the_limit() -> None:
    index = _indexed({name: 10 for name in "abcdef"})
    found = index.holders(KEYS, 3)
    assert len(found) == 3 and all(blocks == 10 for _, blocks in found)
    assert {name for name, _ in found} <= set("abcdef")


class _Model:
    """The index's semantics in plain Python dicts, one backend at a time: what the table
    (hashing/_block_table.c) must agree with after every operation."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.confirmed: dict[str, OrderedDict[int, int]] = {}
        self.speculative: dict[str, OrderedDict[int, float]] = {}

    def _of(self, b: str) -> tuple[OrderedDict[int, int], OrderedDict[int, float]]:
        return self.confirmed.setdefault(b, OrderedDict()), self.speculative.setdefault(
            b, OrderedDict()
        )

    def _trim(self, b: str) -> None:
        for held in self._of(b):
            while len(held) > self.capacity:
                held.popitem(last=False)

    def stored(self, b: str, keys: list[int], engines: list[int]) -> None:
        conf, _ = self._of(b)
        for key, engine in zip(keys, engines, strict=False):
            conf[key] = engine
            conf.move_to_end(key)
        self._trim(b)

    def learn(self, b: str, keys: list[int], at: float) -> None:
        _, spec = self._of(b)
        for key in keys:
            spec[key] = at
            spec.move_to_end(key)
        self._trim(b)

    def touched(self, b: str, keys: list[int], at: float) -> None:
        _, spec = self._of(b)
        for key in reversed(keys):
            if key in spec:
                spec[key] = at
                spec.move_to_end(key)

    def removed(self, b: str, engines: list[int]) -> None:
        conf, spec = self._of(b)
        for key in [k for k, e in conf.items() if e in engines]:
            del conf[key]
            spec.pop(key, None)

    def dropped(self, b: str, keys: list[int], confirmed: bool) -> None:
        conf, spec = self._of(b)
        for key in keys:
            spec.pop(key, None)
            if confirmed:
                conf.pop(key, None)

    def expire(self, now: float) -> None:
        for spec in self.speculative.values():
            while spec and next(iter(spec.values())) <= now:
                spec.popitem(last=False)

    def holders(self, key: int) -> set[str]:
        return {b for b in self.confirmed if key in self.confirmed[b] or key in self.speculative[b]}


def _speculative(index: PrefixIndex, backend: str) -> list[tuple[int, float]]:
    """`backend`'s speculative (key, expiry) pairs, least recently used first."""
    held = index.held(backend)
    return [] if held is None else index._table.snapshot(held.member, 1)


def _views(how: str, tmp_path: Path, capacity: int = 1_000_000) -> list[PrefixIndex]:
    """Two views of one index: the same object, or two indexes over one shared file (two
    mappings at different addresses, as two processes of a host have)."""
    if how == "private":
        index = PrefixIndex(capacity)
        return [index, index]
    views = [PrefixIndex(capacity), PrefixIndex(capacity)]
    for view in views:
        view.share(str(tmp_path / "index-gpu"))
    return views


@pytest.mark.parametrize("how", ["private", "shared"])
def test_the_table_follows_every_change(how: str, tmp_path: Path) -> None:
    """A seeded run of every operation against `_Model`: after each one, each backend
    holds exactly the model's keys of each kind, in its LRU order, with its engine
    hashes and expiries, and each key names exactly its holders. Shared, the operations
    go through two views of the file in turn and each check reads the other view."""
    rng = random.Random(7)
    backends = [f"b{i}" for i in range(12)]  # a key's holders are one, a few or many
    views, model = _views(how, tmp_path, capacity=40), _Model(40)
    docs = [list(range(d * 1000, d * 1000 + 16 * 12)) for d in range(4)]
    chains = [chain(ROOT, ids, 16) for ids in docs]
    universe = {key for keys in chains for key in keys}
    engines = iter(range(10**6))
    ops = ["stored", "learn", "touched", "removed", "dropped", "cleared", "expire", "forget"]
    for step in range(1500):
        b, d, n = rng.choice(backends), rng.randrange(4), rng.randrange(1, 13)
        op = rng.choice([*ops, "restore"])
        index, reader = views[step % 2], views[1 - step % 2]
        keys = chains[d][:n]
        if op == "stored":
            made = [next(engines) for _ in range(n)]
            index.stored(b, None, made, docs[d][: n * 16], 16, ROOT)
            model.stored(b, keys, made)
        elif op in ("learn", "touched"):
            at = float(step + rng.randrange(20))
            getattr(index, op)(b, keys, at)
            getattr(model, op)(b, keys, at)
        elif op == "removed":  # the tail of what it holds, as vLLM evicts
            gone = [engine for _, engine in index.snapshot(b)[-rng.randrange(1, 4) :]]
            index.removed(b, gone)
            model.removed(b, gone)
        elif op == "dropped":
            confirmed = rng.random() < 0.5
            index.dropped(b, keys[n // 2 :], confirmed)
            model.dropped(b, keys[n // 2 :], confirmed)
        elif op in ("cleared", "forget"):
            for view in views:  # every process forgets a backend that left
                getattr(view, op)(b)
            model.confirmed.pop(b, None)
            if op == "forget":
                model.speculative.pop(b, None)
        elif op == "expire":
            index.expire(now=float(step))
            model.expire(float(step))
        else:
            other = rng.choice(backends)
            index.restore(b, index.snapshot(other))
            if how == "private":  # a shared table is the snapshots' source: it stays
                model.confirmed[b] = OrderedDict(model.confirmed.get(other, {}))
            model._of(b)
        for name in backends:
            conf, spec = model._of(name)
            reader.set_capacity(name, 40)  # each process sizes every backend of its fleet
            assert reader.snapshot(name) == list(conf.items()), (step, op, name)
            assert reader.size(name) == (len(conf), len(spec)), (step, op, name)
            assert _speculative(reader, name) == list(spec.items()), (step, op, name)
            assert [reader.expiry(name, k) for k in spec] == list(spec.values())
            assert all(reader.key_of(name, e) == k for k, e in conf.items())
        for key in universe:
            assert {name for name, _ in reader.holders([key], 12)} == model.holders(key), step
    assert reader.holder_keys() == sum(1 for key in universe if model.holders(key)) > 0


@pytest.mark.parametrize("how", ["private", "shared"])
def test_every_key_is_found_after_the_tables_grew_and_shrank(how: str, tmp_path: Path) -> None:
    """The table's arrays and id tables grow many times over (1,024 slots at first) and
    entries are freed and reused: every key held is found, with its holders, and none
    that left. Keys of 3 backends, 40,000 each, half of them held by two. Shared, one
    view writes and the other reads: every array the writer moved is found."""
    index, reader = _views(how, tmp_path)
    keys = [chain(ROOT, list(range(d * 64, d * 64 + 64)), 16) for d in range(30_000)]
    for d, four in enumerate(keys):
        index.learn(f"b{d % 3}", four, 1e12)
        if d % 2:
            index.stored(
                f"b{(d + 1) % 3}",
                None,
                [d * 4 + i for i in range(4)],
                list(range(d * 64, d * 64 + 64)),
                16,
                ROOT,
            )
    for d in range(0, 30_000, 7):
        index.dropped(f"b{d % 3}", keys[d][2:])
    for d in range(1, 30_000, 2):
        index.removed(f"b{(d + 1) % 3}", [d * 4 + 3])
    for d, four in enumerate(keys):
        own = 2 if d % 7 == 0 else 4
        assert reader.longest_prefix(four, f"b{d % 3}") == own, d
        other = 3 if d % 2 else 0
        assert reader.longest_prefix(four, f"b{(d + 1) % 3}") == other, d
        expected = {(f"b{d % 3}", own)} | ({(f"b{(d + 1) % 3}", other)} if other else set())
        assert set(reader.holders(four, 8)) == expected, d
    assert reader.holder_keys() == sum(
        max(2 if d % 7 == 0 else 4, 3 if d % 2 else 0) for d in range(30_000)
    )


@pytest.mark.parametrize("how", ["private", "shared"])
def test_keys_are_found_and_removed_while_the_id_tables_grow(how: str, tmp_path: Path) -> None:
    """An id table that grows moves its ids over a few puts at a time, a lookup trying
    the new slots and the old: checked after every batch of 48 puts (most checks fall
    while a table is moving), keys learned and confirmed stay found, keys dropped and
    blocks removed meanwhile (from either slots) are gone, in both views."""
    index, reader = _views(how, tmp_path)
    rng = random.Random(7)
    held: dict[int, str] = {}  # key -> its backend
    engines: dict[str, dict[int, int]] = {"b0": {}, "b1": {}}  # engine hash -> key
    for name in engines:  # each process knows the fleet
        reader.set_capacity(name, 1_000_000)
    for batch in range(1_200):
        keys = [batch * 48 + i + 1 for i in range(48)]
        b = f"b{batch % 2}"
        if batch % 3:
            index.learn(b, keys, 1e12)
        else:
            hashes = [1_000_000 + k for k in keys]
            index.placed(b, zip(keys, hashes, strict=True))
            engines[b].update(zip(hashes, keys, strict=True))
        held.update(dict.fromkeys(keys, b))
        gone = rng.sample(list(held), 24)
        removed_from = [held[key] for key in gone]
        for key in gone[:12]:
            index.dropped(held.pop(key), [key], confirmed=True)
        for key in gone[12:]:
            name = held.pop(key)
            found = [h for h, k in engines[name].items() if k == key]
            if found:
                index.removed(name, found)
            else:
                index.dropped(name, [key])
        for key in rng.sample(list(held), min(48, len(held))) + keys:
            expected = [(held[key], 1)] if key in held else []
            assert reader.holders([key], 4) == expected, batch
            assert [reader.longest_prefix([key], name) for name in engines] == [
                int(held.get(key) == name) for name in engines
            ], batch
        for key, name in zip(gone, removed_from, strict=True):
            assert reader.holders([key], 4) == [], batch
            assert reader.longest_prefix([key], name) == 0, batch
    assert reader.holder_keys() == len(held)


def test_a_full_index_adds_nothing_the_garbage_collector_walks() -> None:
    """A hundred thousand keys on 64 backends are flat arrays in the table, not Python
    containers: the objects the cyclic collector tracks do not grow with them (a million
    keys in OrderedDicts cost a collector pass tens of milliseconds on the event loop)."""
    index = PrefixIndex(capacity=4096)
    gc.collect()
    before = len(gc.get_objects())
    for b in range(64):
        ids = list(range(b * 100_000, b * 100_000 + 16 * 1600))
        index.learn(f"b{b}", chain(ROOT, ids, 16), 1e12)
        index.stored(f"b{b}", None, list(range(b * 10_000, b * 10_000 + 1600)), ids, 16, ROOT)
    gc.collect()
    assert index.size("b63") == (1600, 1600)
    assert len(gc.get_objects()) - before < 100
