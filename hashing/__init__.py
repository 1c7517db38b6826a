"""Pure, synchronous hashing: from a request's prompt to the backend that should serve it.

The request path through this package, one module per step:

    canonical    request fields → routing text (unambiguous, prefix-preserving, cut early)
    tokens       routing text → key bytes of its leading n tokens (approximate or HF)
    fingerprint  namespace(model, tenant) + key → xxh3_64 fingerprint
    ring         fingerprint → owner member, then a deterministic spillover order

Rules: imports no other project package and none of asyncio, aiohttp, grpc or
prometheus_client (stdlib, msgspec and xxhash only; ``tokenizers`` when an HF tokenizer is
built). Nothing depends on ``hash()``, so every process and replica computes the same values.
The public surface is the modules: ``from hashing.ring import HashRing``.
"""

from hashing import canonical, fingerprint, ring, tokens

__all__ = ["canonical", "fingerprint", "ring", "tokens"]
