"""Pure, synchronous hashing: from a request's prompt to the backend that should serve it.

The request path through this package, one module per step:

    canonical    request fields → routing text (unambiguous, prefix-preserving, cut early)
    tokens       routing text → key bytes of its leading n tokens (approximate or HF)
    fingerprint  namespace(model, tenant) + key → xxh3_64 fingerprint
    ring         fingerprint → owner member, then a deterministic spillover order

and for KV-aware routing:

    chat_tokens   the backend's exact token ids (ChatML4 = `kvroute sim`'s tokenizer),
                  their block keys, cached by prefix checkpoints
    hf_chat       vLLM's ids from a HuggingFace tokenizer dir (chat template + encode)
    blocks        token ids → chained xxh3 block keys, rooted in (model, cache_salt)
    prefix_index  which backend holds which block keys (KV events + speculative inserts),
                  each backend's bounds, over `_block_table` (C: flat arrays, per
                  backend in LRU order, per key its holders)
    prefix_lookup its reads: longest prefix per backend, longest holders
    tiered_index  the same per cache medium: GPU, offload tiers (CPU, storage, shared)
    cache_trust   the answers' cached tokens correct the index and bound, per backend,
                  how many of its placements it trusts (a learned capacity)
    rendezvous    weighted highest-random-weight ranks: where a prefix no one holds goes

Rules: imports no other project package and none of asyncio, aiohttp, grpc or
prometheus_client (stdlib, msgspec, xxhash, numpy and its own C table `_block_table` only;
``tokenizers`` when an HF tokenizer is built). Nothing depends on ``hash()``, so every
process and replica computes the same values.
The public surface is the modules: ``from hashing.ring import HashRing``.
"""

from hashing import (
    blocks,
    cache_trust,
    canonical,
    chat_tokens,
    fingerprint,
    hf_chat,
    prefix_index,
    prefix_lookup,
    rendezvous,
    ring,
    tiered_index,
    tokens,
)

__all__ = [
    "blocks",
    "cache_trust",
    "canonical",
    "chat_tokens",
    "fingerprint",
    "hf_chat",
    "prefix_index",
    "prefix_lookup",
    "rendezvous",
    "ring",
    "tiered_index",
    "tokens",
]
