"""A faithful vLLM simulator: K fake vLLM servers in one process, for router tests and benches.

Each backend speaks vLLM 0.33's HTTP surface (OpenAI chat/completions with SSE,
embeddings, /metrics under vLLM's names, /tokenize, /health, ...) and, optionally, its
ZMQ KV-cache events.
Behind it runs a small model of vLLM V1: a prefix cache of hashed blocks with LRU
eviction of unreferenced blocks (kv_cache.py), continuous batching with chunked prefill
and recompute preemption (scheduler.py), and a step loop whose durations follow a
Llama-70B-class cost model scaled by time_scale (engine.py). Faults are injectable at
start and at runtime (POST /sim/fault, /sim/restart).

Modules, along one request: cli -> fleet (sockets) -> backend (one server's state) and
server (HTTP, faults; what it reports: reports) -> protocol (bodies, responses) ->
tokenizer -> engine -> scheduler -> kv_cache (its CPU tier: cpu_tier) ->
kv_events/publisher (ZMQ); metrics beside the engine; embedding (/v1/embeddings, off the
engine); params holds every knob.

Imports nothing of the router or its policies (it stands in for vLLM, which knows nothing
of its router) and nothing else of bench; hashing/ only, for the chat template and
tokenizer a router reproduces. The harness and the studies import it.

    fleet = await start_fleet(4, SimParams(time_scale=0.1, kv_events=True))
    ... fleet.urls, fleet.backends[i].stats, fleet.backends[i].set_fault(Fault(mode="fail"))
    await fleet.stop()
"""

from bench.sim.backend import SimBackend
from bench.sim.cli import main
from bench.sim.engine import EngineStats, SimEngine
from bench.sim.fleet import SimFleet, start_fleet
from bench.sim.params import Fault, SimConfig, SimParams, load_config
from bench.sim.tokenizer import render_chat, tokenize

__all__ = [
    "EngineStats",
    "Fault",
    "SimBackend",
    "SimConfig",
    "SimEngine",
    "SimFleet",
    "SimParams",
    "load_config",
    "main",
    "render_chat",
    "start_fleet",
    "tokenize",
]
