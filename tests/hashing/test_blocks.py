"""hashing/blocks.py: the block-key chain, in one C call and block by block, agree."""

from __future__ import annotations

import random

import pytest
import xxhash

from hashing.blocks import chain, chain_each, chain_packed, root_key
from hashing.tokens import pack_ids


@pytest.mark.parametrize("block_size", [1, 16, 32, 64, 128])
@pytest.mark.parametrize("tokens", [0, 15, 16, 100, 4096 + 7])
def test_the_c_chain_is_the_xxhash_chain(block_size: int, tokens: int) -> None:
    """Every full block's key (a trailing partial block has none), whatever XXH3 path
    the block's length takes (64 to 512 bytes here)."""
    rng = random.Random(block_size * 10_000 + tokens)
    packed = pack_ids([rng.randrange(2**32) for _ in range(tokens)])
    parent = root_key("m", "salt")
    assert chain_packed(parent, packed, block_size) == chain_each(parent, packed, block_size)
    assert len(chain_packed(parent, packed, block_size)) == tokens // block_size


def test_each_key_seeds_the_next() -> None:
    ids = list(range(48))
    first, second, third = chain(7, ids, 16)
    assert first == xxhash.xxh3_64_intdigest(pack_ids(ids[:16]), seed=7)
    assert third == xxhash.xxh3_64_intdigest(pack_ids(ids[32:]), seed=second)
