"""KV_AWARE's parameters (`routing:` with `strategy: KV_AWARE`), as policy.py lists them."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from policies.base import PolicyParams

__all__ = ["DEFAULT_TIERS", "KvAwareParams", "KvTierParams", "KvTokenizerParams"]

Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]


class KvTokenizerParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The backends' exact tokenizer: "hf" (a local HuggingFace tokenizer directory with
    its chat template) for vLLM, "backend" (ask a backend's POST /tokenize, cached; costs
    a round trip per new prompt), or "chatml4" (`kvroute sim`'s); or none, "text": keys
    of the rendered text itself, 4 characters a token, which is what a fleet without KV
    events gets unless the file names a tokenizer (no event's ids need matching)."""

    kind: Literal["chatml4", "hf", "backend", "text"] = "chatml4"
    path: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "hf" and not self.path:
            raise ValueError("tokenizer.kind 'hf' needs tokenizer.path (a tokenizer directory)")


class KvTierParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """An offload tier, named by the KV events' medium (lowercase): what loading one of its
    tokens into the GPU costs, and whether every backend reads it (a remote store) or only
    the backend that stored it."""

    load_s_per_token: NonNegative
    shared: bool = False


#: The offload tiers vLLM's connectors publish, priced for the hardware the other defaults
#: describe (prefill_tokens_per_s 10,000: Llama-3.1-70B BF16 on 8 A100s). A token's KV is
#: 320 KiB, 40 KiB per GPU. From CPU memory each GPU loads its share over its own PCIe Gen4
#: x16 link (~25 GB/s): 1.6 µs, a 60th of a prefilled token. From local storage, four Gen4
#: NVMe drives (~6.5 GB/s each) read 320 KiB in ~13 µs, an eighth of a prefilled token.
DEFAULT_TIERS = {
    "cpu": KvTierParams(load_s_per_token=1.6e-6),
    "storage": KvTierParams(load_s_per_token=1.3e-5),
}


class KvAwareParams(PolicyParams, tag="KV_AWARE"):
    #: a pool's hardware sets its speeds and its caps; blocks, tokenizer, index and
    #: tiers describe what every pool shares
    pool_tunable = frozenset(
        {
            "prefill_tokens_per_s",
            "decode_step_s",
            "decode_s_per_request",
            "waiting_s_per_request",
            "miss_penalty",
            "harm_weight",
            "eviction_penalty",
            "tie_fraction",
            "tie_seconds",
            "concurrency_threshold",
            "max_queue_s",
            "sample",
        }
    )
    block_size: Annotated[int, Meta(ge=1, le=4096)] = 16
    tokenizer: KvTokenizerParams = KvTokenizerParams()
    max_prefix_tokens: Annotated[int, Meta(ge=1)] = 32768
    prefill_tokens_per_s: Positive = 10000.0
    #: a decode step's duration, alone and per request in the batch (the priors of the
    #: learned speeds): the reference hardware's (bench/sim/params.py)
    decode_step_s: NonNegative = 0.025
    decode_s_per_request: NonNegative = 0.00015
    #: the answer's expected tokens when neither the request nor the router's past
    #: answers say
    output_tokens: Annotated[int, Meta(ge=0)] = 256
    waiting_s_per_request: NonNegative = 0.05
    miss_penalty: NonNegative = 1.0
    #: the weight of the delay a prefill puts into the steps of the requests already on a
    #: backend, against the request's own latency (cost.py `harm`)
    harm_weight: NonNegative = 0.5
    #: the prefill a cache that proved small will redo per block a placement evicts
    eviction_penalty: NonNegative = 1.0
    tie_fraction: NonNegative = 0.1
    tie_seconds: NonNegative = 0.005
    concurrency_threshold: Annotated[int, Meta(ge=1)] | None = None
    max_queue_s: Positive | None = None
    speculative_ttl_s: Positive = 2.0
    approximate_ttl_s: Positive = 600.0
    index_capacity: Annotated[int, Meta(ge=1)] = 1_000_000
    sample: Annotated[int, Meta(ge=0)] = 3
    tiers: dict[str, KvTierParams] = msgspec.field(default_factory=lambda: dict(DEFAULT_TIERS))
    seed: Annotated[int, Meta(ge=0)] | None = None

    def __post_init__(self) -> None:
        for medium in self.tiers:
            if medium != medium.lower() or medium == "gpu":
                raise ValueError(
                    f"tiers: {medium!r}: name an offload medium in lowercase as the KV "
                    "events do (cpu, storage, ...); the GPU is not a tier"
                )
