"""What a simulated server's routes report about it: its model cards, a finished
prefill's transfer parameters, its KV event sources, and /sim/stats (with the speeds a
router could learn). Read-only views of `SimBackend`'s state (backend.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from bench.sim.protocol import model_card

if TYPE_CHECKING:
    from bench.sim.backend import SimBackend
    from bench.sim.request import SimRequest


def model_cards(b: SimBackend) -> list[dict[str, Any]]:
    """GET /v1/models `data`: the base model, then one card per LoRA adapter."""
    base = b.params.model
    adapters = [(n, b.loras.root(n), base) for n in b.loras.names]
    return [
        model_card(*card, b.created, b.params.max_model_len)
        for card in [(base, base, None), *adapters]
    ]


def kv_transfer_params(b: SimBackend, req: SimRequest) -> dict[str, Any] | None:
    """What a finished prefill for a remote decode tells the decode instance."""
    if not req.remote_decode:
        return None
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": req.remote_block_ids,
        "remote_engine_id": b.engine_id,
        "remote_request_id": req.request_id,
        "remote_host": b.host,
        "remote_port": b.port,
        "tp_size": 1,
    }


def kv_event_sources(b: SimBackend) -> dict[str, Any]:
    if b.publisher is None:
        return {}
    p = b.params
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": b.publisher.endpoint,
        "replay_endpoint": b.publisher.replay_endpoint,
        "buffer_steps": p.kv_events_buffer_steps,
        "hwm": p.kv_events_hwm,
        "max_queue_size": 100000,
        "topic": b.publisher.topic,
    }
    return {"0": config}


def snapshot(b: SimBackend) -> dict[str, Any]:
    """GET /sim/stats: totals plus the live state of the engine."""
    e = b.engine
    live = {
        "running": e.num_running,
        "waiting": e.num_waiting,
        "inflight": b.inflight,
        "kv_cache_usage": e.kv.usage,
        "cached_blocks": e.kv.num_cached,
        "cpu_cached_blocks": e.kv.num_cpu_cached,
        "fault": msgspec.to_builtins(b.fault),
        "kv_role": b.params.kv_role,
        "lora_loads": b.loras.loads,
        "lora_unloads": b.loras.unloads,
        "loaded_adapters": b.loras.names,
        "loading_adapters": b.loras.loading,
        "true_speeds": true_speeds(b),
    }
    return {**msgspec.to_builtins(b.stats), **live}


def true_speeds(b: SimBackend) -> dict[str, float | None]:
    """What a router could learn about this backend, in simulated time: prefill tokens
    per second, and a decode step's time (base + per sequence in the batch), for
    `speed` and any `slow` fault now in force. A router observes wall-clock time:
    multiply durations (divide rates) by `time_scale` to compare."""
    p = b.params
    pace = p.speed / b.engine.slow_factor
    return {
        "speed": pace,
        "prefill_tokens_per_s": 1000.0 * pace / p.prefill_per_token_ms
        if p.prefill_per_token_ms
        else None,
        "decode_step_base_ms": p.step_base_ms / pace,
        "decode_per_seq_ms": p.decode_per_seq_ms / pace,
        "time_scale": p.time_scale,
    }
