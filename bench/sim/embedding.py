"""POST /v1/embeddings of the simulator: OpenAI's request and answer shapes (vLLM 0.33's
`embd-` ids and usage), with vectors that cost no model.

An input is a string (tokenized as the simulator tokenizes prompts) or a list of token
ids; `input` is one of them or a list of them. Each input's vector hashes its tokens
into `dimensions` buckets with a sign each (the hashing trick), then is scaled to unit
length: the same input always gets the same vector, and inputs that share tokens point
the same way, so cosine similarity still ranks texts by what they share. `dimensions`
is honoured up to the native `DIMENSIONS`; `encoding_format: base64` is little-endian
float32, which the openai SDK asks for by default.

Cost: O(tokens + dimensions) per input, one xxh32 per token.
"""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
import xxhash
from msgspec import Meta

from bench.sim.tokenizer import VOCAB_SIZE, tokenize

__all__ = ["DIMENSIONS", "EmbeddingBody", "answer", "inputs", "vector"]

#: the length of a vector when the request gives no `dimensions`
DIMENSIONS = 1024
_SEED = 0x5EED  # not the tokenizer's seed 0, so buckets do not follow token ids


class EmbeddingBody(msgspec.Struct, kw_only=True):
    """The fields the simulator reads; others (`user`, ...) are ignored, as vLLM does."""

    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None


def inputs(value: str | list[str | int | list[int]], max_len: int) -> list[list[int]]:
    """Each input's token ids; ValueError says which input is empty, of another kind or
    longer than `max_len` tokens."""
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        value = [value]  # one input given as token ids
    items = [value] if isinstance(value, str) else value
    if not items:
        raise ValueError("`input` must not be empty.")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            tokens = tokenize(item)
        elif isinstance(item, list) and all(0 <= t < VOCAB_SIZE for t in item):
            tokens = item
        else:
            raise ValueError(
                f"`input[{i}]` is neither a string nor a list of token ids in [0, {VOCAB_SIZE})."
            )
        if not tokens:
            raise ValueError(f"`input[{i}]` must not be empty.")
        if len(tokens) > max_len:
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {len(tokens)} tokens in `input[{i}]`. Please reduce the length."
            )
        out.append(tokens)
    return out


def vector(tokens: list[int], dimensions: int) -> list[float]:
    """`tokens` hashed into `dimensions` signed buckets, at unit length."""
    buckets = [0.0] * dimensions
    for token in tokens:
        h = xxhash.xxh32_intdigest(token.to_bytes(4, "little"), _SEED)
        buckets[h % dimensions] += 1.0 if h & 0x80000000 else -1.0
    norm = math.sqrt(sum(x * x for x in buckets)) or 1.0  # all cancelled: zeros stay zeros
    return [x / norm for x in buckets]


def answer(body: EmbeddingBody, prompts: list[list[int]], model: str) -> dict[str, Any]:
    """The response to `body`, whose `inputs` are `prompts`."""
    dimensions = body.dimensions or DIMENSIONS
    data = []
    for index, tokens in enumerate(prompts):
        values = vector(tokens, dimensions)
        embedding: list[float] | str = values
        if body.encoding_format == "base64":
            embedding = base64.b64encode(struct.pack(f"<{dimensions}f", *values)).decode()
        data.append({"index": index, "object": "embedding", "embedding": embedding})
    tokens = sum(map(len, prompts))
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }
