"""Every simulator knob, typed and checked once (`SimParams`, `Fault`, `SimConfig`).

`SimParams` describes one simulated vLLM server; a fleet runs K identical ones. `SimConfig`
adds the fleet-level knobs the CLI and YAML file need. Each field carries a `Meta`
description, which the CLI turns into its `--help` text, so the docs live next to the value.
Cross-field rules sit in `__post_init__`; after that, code trusts the values.
"""

from typing import Annotated, Literal

import msgspec
import yaml
from msgspec import Meta

FaultMode = Literal["none", "fail", "hang", "close_midstream", "slow"]
KVRole = Literal["both", "prefill", "decode"]


class Fault(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One injected failure, as posted to `POST /sim/fault`.

    none: healthy. fail: inference routes and /health answer `status` with a vLLM error
    body. hang: inference routes and /health never answer (until the client gives up, the
    backend restarts or stops). close_midstream: a stream is cut (TCP abort, no [DONE])
    after `after_chunks` SSE chunks; a non-stream request is cut before its response.
    slow: every engine step takes `factor` times longer.
    """

    mode: FaultMode = "none"
    status: Annotated[int, Meta(ge=400, le=599)] = 503
    after_chunks: Annotated[int, Meta(ge=0)] = 3
    factor: Annotated[float, Meta(gt=0)] = 5.0


NO_FAULT = Fault()


class SimParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Parameters of one simulated vLLM server; defaults model Llama-3.1-70B on one node.

    Reference hardware: BF16 weights, tensor parallel 8 on 8x A100-40GB (1.55 TB/s HBM,
    312 dense BF16 TFLOPS per GPU), vLLM V1 defaults otherwise.

    - KV capacity, `num_gpu_blocks` = 24000 (384k tokens). One token's KV is 80 layers x
      8 KV heads x 128 dims x 2 (K and V) x 2 bytes = 320 KiB, i.e. 40 KiB per GPU at TP8.
      Per GPU: 40 GB x 0.9 (gpu_memory_utilization) - 17.6 GB of weights (141 GB / 8)
      - ~2.5 GB activations and CUDA graphs = ~16 GB, / 40 KiB = ~390k tokens. That holds
      about 48 distinct 8k-token prefixes, so random routing of many prefixes churns it.
    - Decode, `step_base_ms` = 25: a step streams all weights once (17.6 GB / 1.55 TB/s =
      11.4 ms per GPU), plus 160 NVLink all-reduces, sampling and launch overhead; measured
      70B TP8 A100 inter-token latencies sit around 25-30 ms at small batch.
    - `decode_per_seq_ms` = 0.15: each sequence in the batch adds its attention KV reads
      (a 4k-token context is 160 MB per GPU, ~0.1 ms) and per-sequence sampling, so a
      batch of 64 takes ~35 ms per step.
    - Prefill, `prefill_per_token_ms` = 0.1 (10k tokens/s): a token costs 2 x 70.6 GFLOP;
      8 x 312 TFLOPS at the ~55% MFU of large chunked-prefill batches gives ~10k tokens/s.
      An 8000-token uncached prompt therefore waits ~0.8 s for its first token, a cached
      one ~25 ms: TTFT depends on uncached tokens and queueing, as on real hardware.
    - `max_num_batched_tokens` = 8192 and `max_num_seqs` = 256: vLLM V1's API-server
      defaults on large GPUs (chunked prefill always on).
    - `max_model_len` = 32768: a usual serving limit; it must fit in the KV capacity.

    - CPU tier, `num_cpu_blocks` = 0 (off): KV offloading to CPU memory (vLLM's
      OffloadingConnector, LMCache), as a victim cache of the blocks the GPU pool evicts.
      `cpu_load_per_token_ms` = 0.0016: each GPU loads its 40 KiB share of a token over
      its own PCIe Gen4 x16 link (~25 GB/s effective): 1.6 µs, a 60th of a prefilled
      token. The load is part of the step that admits the request (as LMCache loads layer
      by layer inside the forward pass).

    - Prefill/decode disaggregation (vLLM's NixlConnector), `kv_role`: "prefill" is vLLM's
      kv_producer (it only serves `do_remote_decode` transfers), "decode" is kv_consumer
      (only `do_remote_prefill`), "both" is kv_both and also what a server without a
      connector would be. `kv_transfer_per_token_ms` = 0.002: the decode side reads each
      GPU's 40 KiB share of a token from its prefill peer over NIXL/UCX on RDMA, one
      200 Gb/s HDR InfiniBand NIC per GPU (as in a DGX A100) at ~20 GB/s effective: 2 µs.
      The read is charged to the step that admits the request, like a CPU-tier load.
    - Runtime LoRA loading (`runtime_lora_updating`, vLLM's
      VLLM_ALLOW_RUNTIME_LORA_UPDATING): `max_loras` bounds the adapters served at once
      (static `lora_adapters` included; vLLM splits this into max_loras per batch and
      max_cpu_loras resident, the simulator keeps the one resident bound). A load takes
      `lora_load_ms` = 200 (reading a ~1 GB rank-16 70B adapter from local NVMe and
      copying it to the GPUs), during which the adapter is not served yet.

    `time_scale` multiplies every simulated duration (0.1 = ten times faster); metrics and
    client-visible latencies are wall-clock, i.e. already scaled. `speed` models other
    hardware (an A100 beside an H100): every step's simulated duration is divided by it,
    so prefill tokens/s and decode steps/s both scale by `speed`.
    """

    model: Annotated[str, Meta(min_length=1, description="served model name")] = "sim-llama-70b"
    lora_adapters: Annotated[
        list[str], Meta(description="extra served names that act as LoRA adapters")
    ] = []
    max_model_len: Annotated[int, Meta(ge=1, description="prompt + output token limit")] = 32768
    block_size: Annotated[int, Meta(ge=1, description="tokens per KV block")] = 16
    num_gpu_blocks: Annotated[
        int, Meta(ge=2, description="KV capacity in blocks (one is vLLM's reserved null block)")
    ] = 24000
    enable_prefix_caching: Annotated[bool, Meta(description="reuse cached prefix blocks")] = True
    num_cpu_blocks: Annotated[
        int, Meta(ge=0, description="CPU offload tier in blocks: what the GPU evicts (0 = off)")
    ] = 0
    cpu_load_per_token_ms: Annotated[
        float, Meta(ge=0, description="step cost per token loaded from the CPU tier, ms")
    ] = 0.0016
    kv_role: Annotated[
        KVRole,
        Meta(description="P/D role: prefill = kv_producer, decode = kv_consumer, both = kv_both"),
    ] = "both"
    kv_transfer_per_token_ms: Annotated[
        float, Meta(ge=0, description="step cost per token read from a remote prefill, ms")
    ] = 0.002
    runtime_lora_updating: Annotated[
        bool, Meta(description="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    ] = False
    max_loras: Annotated[
        int, Meta(ge=1, description="LoRA adapters served at once (static ones included)")
    ] = 4
    lora_load_ms: Annotated[
        float, Meta(ge=0, description="simulated time a runtime LoRA load takes, ms")
    ] = 200.0
    max_num_seqs: Annotated[int, Meta(ge=1, description="max running requests per step")] = 256
    max_num_batched_tokens: Annotated[
        int, Meta(ge=1, description="token budget per engine step (chunked prefill)")
    ] = 8192
    step_base_ms: Annotated[
        float, Meta(ge=0, description="fixed cost of one engine step (weights read), ms")
    ] = 25.0
    decode_per_seq_ms: Annotated[
        float, Meta(ge=0, description="extra step cost per decoding sequence, ms")
    ] = 0.15
    prefill_per_token_ms: Annotated[
        float, Meta(ge=0, description="extra step cost per uncached prompt token, ms")
    ] = 0.1
    time_scale: Annotated[
        float, Meta(gt=0, description="multiplier on every simulated duration (0.1 = 10x faster)")
    ] = 1.0
    speed: Annotated[
        float,
        Meta(gt=0, description="this hardware's speed: every step takes 1/speed (0.5 = half)"),
    ] = 1.0
    default_max_tokens: Annotated[
        int, Meta(ge=1, description="output length when a request sets no max_tokens")
    ] = 16
    kv_events: Annotated[bool, Meta(description="publish KV cache events over ZMQ")] = False
    kv_events_encoding: Annotated[
        Literal["array", "map"],
        Meta(description="event shape: array = vLLM <=0.23, map = vLLM >=0.24"),
    ] = "map"
    kv_events_topic: Annotated[
        str, Meta(description="frame-0 topic; {host}, {port}, {model} are substituted")
    ] = ""
    kv_events_base_port: Annotated[
        int,
        Meta(ge=0, le=65535, description="PUB port of instance i is P+i, replay P+N+i; 0 = free"),
    ] = 0
    kv_events_buffer_steps: Annotated[
        int, Meta(ge=1, description="replay ring size in batches (vLLM's default is 10000)")
    ] = 1000
    kv_events_hwm: Annotated[int, Meta(ge=1, description="PUB send high-water mark")] = 100000
    faults: Annotated[
        dict[int, Fault], Meta(description="fault per backend index, active from start")
    ] = {}

    def __post_init__(self) -> None:
        capacity = (self.num_gpu_blocks - 1) * self.block_size
        if self.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the KV capacity of "
                f"{capacity} tokens ((num_gpu_blocks - 1) * block_size)"
            )
        if self.model in self.lora_adapters:
            raise ValueError(f"LoRA adapter name {self.model!r} equals the model name")
        if len(set(self.lora_adapters)) > self.max_loras:
            raise ValueError(
                f"{len(set(self.lora_adapters))} LoRA adapters exceed max_loras {self.max_loras}"
            )
        try:
            self.kv_events_topic.format(host="", port=0, model="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"kv_events_topic: only {{host}}, {{port}}, {{model}}: {e}") from e


class SimConfig(SimParams, kw_only=True):
    """SimParams plus the fleet-level knobs of the CLI and its YAML file."""

    instances: Annotated[
        int, Meta(ge=1, description="how many vLLM servers to simulate, each on its own port")
    ] = 4
    host: Annotated[str, Meta(description="address every server binds")] = "127.0.0.1"
    base_port: Annotated[
        int, Meta(ge=0, le=65535, description="HTTP port of instance i is P+i; 0 = free ports")
    ] = 0
    roles: Annotated[
        list[KVRole],
        Meta(
            description="kv_role of each instance in order, e.g. --roles prefill prefill "
            "decode; empty = every instance has --kv-role"
        ),
    ] = []
    speeds: Annotated[
        list[Annotated[float, Meta(gt=0)]],
        Meta(
            description="speed of each instance in order, e.g. --speeds 1,1,0.5,0.5 (a mixed "
            "fleet); empty = every instance has --speed"
        ),
    ] = []

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.roles and len(self.roles) != self.instances:
            raise ValueError(f"{len(self.roles)} roles for {self.instances} instances")
        if self.speeds and len(self.speeds) != self.instances:
            raise ValueError(f"{len(self.speeds)} speeds for {self.instances} instances")
        unknown = sorted(i for i in self.faults if not 0 <= i < self.instances)
        if unknown:
            raise ValueError(
                f"faults name instances {unknown}, but only 0..{self.instances - 1} exist"
            )


def load_config(path: str | None, overrides: dict[str, object]) -> SimConfig:
    """Build a SimConfig from an optional YAML file, then `overrides` (explicit flags).

    Raises msgspec.ValidationError (naming the field) or ValueError on a bad value.
    """
    raw: dict[str, object] = {}
    if path is not None:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
    return msgspec.convert({**raw, **overrides}, SimConfig)


def scaled_seconds(params: SimParams, ms: float) -> float:
    """Wall-clock seconds for a simulated duration of `ms` milliseconds."""
    return ms * params.time_scale / 1000.0
