"""Memory of the prefix index per block key per backend, and the bound its LRU sets.

Run: .venv/bin/pytest bench/micro/test_bench_index_memory.py -s   (prints the figures)
Measured as the table's own count of what it allocated (`nbytes`: its entry and key
arrays and its id tables at their current sizes, hashing/_block_table.c; they live in
memory maps, which tracemalloc does not see), divided by the (key, backend) pairs it
then holds. Keys come as
vLLM's BlockStored events leave them (confirmed, with a 64-bit engine hash each) or
from the router's own decisions (speculative, a backend without KV events); each
8,192-token document is held by one backend, or by two (its keys then share one key
record).

Per backend the index keeps at most `capacity` confirmed keys and as many speculative
ones (LRU; the backend's `num_gpu_blocks` once scraped, KvAwareParams.index_capacity
before), so a fleet's index costs at most bytes-per-pair x the sum of its capacities:
test_a_fleet_of_1024 prints that budget for KV capacities of 100k to 500k tokens, from
the bytes measured here, after checking on a real 1,024-backend index that the cost is
linear in pairs, and test_the_lru_bounds_memory that overfilling does not grow it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from hashing.blocks import chain, root_key
from hashing.prefix_index import PrefixIndex

ROOT = root_key("m", None)
BLOCK = 16
DOC_BLOCKS = 512  # 8,192 tokens


def _doc(d: int) -> list[int]:
    return [d * 1_000_000 + t for t in range(DOC_BLOCKS * BLOCK)]


def _fill(index: PrefixIndex, backends: int, docs_each: int, copies: int, how: str) -> None:
    """Backends b and b + 1 ... (by `copies`) hold the same `docs_each` documents."""
    rng = random.Random(0)
    for b in range(backends):
        for s in range(docs_each):
            ids = _doc((b // copies) * docs_each + s)
            if how == "confirmed":
                engines = [rng.getrandbits(64) for _ in range(DOC_BLOCKS)]
                index.stored(f"b{b}", None, engines, ids, BLOCK, ROOT)
            else:
                index.learn(f"b{b}", chain(ROOT, ids, BLOCK), expires_at=1e12)


def _traced(build: Callable[[], PrefixIndex]) -> tuple[PrefixIndex, int]:
    """The index `build` returns and the bytes its table allocated."""
    index = build()
    return index, index.nbytes


def _pairs(index: PrefixIndex, backends: int) -> int:
    return sum(sum(index.size(f"b{b}")) for b in range(backends))


def bytes_per_pair(how: str, copies: int, backends: int = 64, docs_each: int = 4) -> float:
    index, size = _traced(lambda: _filled(backends, docs_each, copies, how))
    pairs = _pairs(index, backends)
    assert pairs == backends * docs_each * DOC_BLOCKS
    return size / pairs


def _filled(backends: int, docs_each: int, copies: int, how: str) -> PrefixIndex:
    index = PrefixIndex()
    _fill(index, backends, docs_each, copies, how)
    return index


@pytest.mark.parametrize("copies", [1, 2])
@pytest.mark.parametrize("how", ["confirmed", "speculative"])
def test_bytes_per_key_per_backend(how: str, copies: int) -> None:
    measured = bytes_per_pair(how, copies)
    print(f"\n{how}, each document on {copies}: {measured:.0f} bytes per key per backend")
    assert measured > 0


def test_the_lru_bounds_memory() -> None:
    """Three and six times a backend's capacity stored: it keeps `capacity` keys, and
    overfilling stops growing the index once its arrays reach their size for capacity
    keys (they grow by doubling and keep their peak, so that is up to twice the exact
    fill)."""
    capacity = 4 * DOC_BLOCKS

    def filled(docs_each: int) -> PrefixIndex:
        index = PrefixIndex(capacity)
        _fill(index, 8, docs_each, 2, "confirmed")
        return index

    sizes = {}
    for docs_each in (4, 12, 24):
        index, sizes[docs_each] = _traced(lambda n=docs_each: filled(n))
        assert _pairs(index, 8) == 8 * capacity
    print(", ".join(f"{n // 4}x capacity: {b / 2**20:.1f} MiB" for n, b in sizes.items()))
    assert sizes[24] < 1.05 * sizes[12] < 2 * sizes[4]


def test_a_fleet_of_1024() -> None:
    """A real index over 1,024 backends (one document each, each on two backends, 524k
    pairs) costs what 64 backends' bytes per pair predict; the budget for a fleet of
    1,024 full backends follows from the LRU bound."""
    per_pair = bytes_per_pair("confirmed", copies=2)
    index, size = _traced(lambda: _filled(1024, 1, 2, "confirmed"))
    pairs = _pairs(index, 1024)
    print(f"\n1,024 backends, {pairs:,} pairs: {size / 2**20:.0f} MiB, {size / pairs:.0f} B/pair")
    assert 0.8 * per_pair < size / pairs < 1.2 * per_pair
    for kv_tokens in (100_000, 200_000, 500_000):
        blocks = kv_tokens // BLOCK
        budget = 1024 * blocks * per_pair
        print(
            f"1,024 x {kv_tokens:,}-token KV ({blocks:,} blocks of {BLOCK}) confirmed: "
            f"{budget / 2**30:.1f} GiB for the host (one table its processes share)"
        )
