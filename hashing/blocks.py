"""Router-side block keys: a chain of xxh3_64 over the full blocks of a token-id sequence.

    root  = xxh3_64(len-prefixed model-or-LoRA name + len-prefixed cache_salt)
    key_0 = xxh3_64(ids of block 0 as little-endian uint32, seed=root)
    key_i = xxh3_64(ids of block i, seed=key_{i-1})

A key therefore stands for the whole prefix up to the end of its block, under the same
isolation vLLM applies (model or adapter, salt). vLLM's own block hashes are never
recomputed (llm-d's dual-key design, see vllm-telemetry.md §3.3): the index re-hashes the
token ids that BlockStored events carry into these keys, so vLLM's hash algorithm, its
NONE_HASH and PYTHONHASHSEED cannot make the router silently miss.

Cost: O(tokens), one xxh3 per block over one packed buffer, in one C call (~20 ns a
block; `chain_packed` takes ids already packed, e.g. by a vectorized tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from hashing._block_table import HASHES_STORES
from hashing._block_table import chain as _native_chain
from hashing.tokens import pack_ids

__all__ = ["chain", "chain_packed", "root_key"]

_UINT32 = 4


def root_key(model: str, salt: str | None) -> int:
    """The seed of a chain: what vLLM isolates caches by (model/LoRA name, cache_salt)."""
    m = model.encode()
    s = b"" if salt is None else b"\x01" + salt.encode()
    return xxhash.xxh3_64_intdigest(len(m).to_bytes(4, "little") + m + s)


def chain(parent: int, ids: Sequence[int], block_size: int) -> list[int]:
    """Keys of every full block of `ids`, chained from `parent` (a root or a block key)."""
    packed = pack_ids(ids)
    if len(ids) == block_size:  # one block, as most stores while decoding are
        return [xxhash.xxh3_64_intdigest(packed, seed=parent)]
    return chain_packed(parent, packed, block_size)


def chain_packed(parent: int, packed: bytes, block_size: int) -> list[int]:
    """The same for ids packed as little-endian uint32s (`hashing.tokens.pack_ids`): in
    one C call where the table module found the xxhash package's XXH3 (~20 ns a block
    against ~140 in this loop), else block by block here."""
    if HASHES_STORES:
        return _native_chain(parent, packed, block_size)
    return chain_each(parent, packed, block_size)


def chain_each(parent: int, packed: bytes, block_size: int) -> list[int]:
    """`chain_packed`, one xxhash call per block."""
    buf = memoryview(packed)
    step = block_size * _UINT32
    digest = xxhash.xxh3_64_intdigest
    keys: list[int] = []
    append = keys.append
    for start in range(0, len(buf) - step + 1, step):
        parent = digest(buf[start : start + step], parent)
        append(parent)
    return keys
