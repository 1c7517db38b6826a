"""PrefixIndex, block keys and the ChatML4 key cache: table-driven cases."""

from __future__ import annotations

import gc
import random

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


def _reverse_map(index: PrefixIndex) -> dict[int, set[str]]:
    return {
        key: {held} if isinstance(held, str) else set(held) for key, held in index._holders.items()
    }


def _asked_each(index: PrefixIndex) -> dict[int, set[str]]:
    found: dict[int, set[str]] = {}
    for backend, h in index._backends.items():
        for key in {*h.confirmed, *h.speculative}:
            found.setdefault(key, set()).add(backend)
    return found


def test_the_reverse_map_follows_every_change() -> None:
    """A seeded run of every operation: after each one, the reverse map names for every
    key exactly the backends whose holdings have it, and no key that none has."""
    rng = random.Random(7)
    index = PrefixIndex(capacity=40)  # twelve backends: a key's holders are one, a few or many
    docs = [list(range(d * 1000, d * 1000 + 16 * 12)) for d in range(4)]
    chains = [chain(ROOT, ids, 16) for ids in docs]
    engines = iter(range(10**6))
    for step in range(1000):
        backend, d = f"b{rng.randrange(12)}", rng.randrange(4)
        n = rng.randrange(1, 13)
        op = rng.choice(["stored", "learn", "removed", "cleared", "expire", "forget", "restore"])
        if op == "stored":
            index.stored(
                backend, None, [next(engines) for _ in range(n)], docs[d][: n * 16], 16, ROOT
            )
        elif op == "learn":
            index.learn(backend, chains[d][:n], expires_at=float(step + rng.randrange(20)))
        elif op == "removed":  # the tail of what it holds, as vLLM evicts
            pairs = index.snapshot(backend)
            index.removed(backend, [engine for _, engine in pairs[-rng.randrange(1, 4) :]])
        elif op == "cleared":
            index.cleared(backend)
        elif op == "expire":
            index.expire(now=float(step))
        elif op == "forget":
            index.forget(backend)
        else:
            index.restore(backend, index.snapshot(f"b{rng.randrange(12)}"))
        assert _reverse_map(index) == _asked_each(index), (step, op)
    assert index.holder_keys() == len(_asked_each(index)) > 0


def test_holdings_frozen_at_start_up_stay_out_of_the_collector() -> None:
    """A backend's containers, reserved before `gc.freeze` (as `kvroute serve` does once
    started), are never young again: not as they fill, not after a clear or a restore.
    A young OrderedDict of a million keys costs a collector pass tens of milliseconds."""
    index = PrefixIndex(capacity=64)
    index.reserve("a")
    h = index._backends["a"]
    containers = {id(h.confirmed), id(h.speculative), id(h.by_engine)}
    gc.collect()
    gc.freeze()
    try:
        keys = chain(ROOT, list(range(16 * 8)), 16)
        index.learn("a", keys, 1e12)
        index.stored("a", None, list(range(100, 108)), list(range(16 * 8)), 16, ROOT)
        index.cleared("a")
        index.restore("a", [(k, e) for e, k in enumerate(keys)])
        young = {id(o) for o in gc.get_objects()}
        assert h is index._backends["a"]
        assert not containers & young
        assert {id(h.confirmed), id(h.speculative), id(h.by_engine)} == containers
    finally:
        gc.unfreeze()
