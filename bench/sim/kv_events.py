"""vLLM KV cache event payloads, built and msgpack-encoded exactly as vLLM sends them.

A batch is always the 3-array `[ts, events, data_parallel_rank]`. Each event is a tagged
union member (tag = class name), encoded one of two ways:
- "array" (vLLM <=0.23): a positional array `[tag, field1, field2, ...]` with every field;
- "map" (vLLM >=0.24): a map `{"type": tag, field: value, ...}` that omits fields whose
  value equals their default (None). Fields without a default are always present.
Only the fields vLLM <=0.23 declared exist here; the later map-only ones (locality,
ownership, session_id, lookahead_token_ids) are always None and so never appear.
Block hashes are uint64 ints (vLLM's default VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
"""

from typing import Any, Literal

import msgspec

Encoding = Literal["array", "map"]
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[str, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]  # KVEvent structs (map form) or positional lists (array form)
    data_parallel_rank: int = 0


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[KVEvent], encoding: Encoding) -> bytes:
    """The msgpack payload frame of one batch."""
    body: list[Any] = events if encoding == "map" else [_as_array(e) for e in events]
    return _ENCODER.encode(KVEventBatch(ts, body))


def _as_array(event: KVEvent) -> list[Any]:
    return [type(event).__name__, *msgspec.structs.astuple(event)]
