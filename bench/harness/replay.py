"""`python -m bench.harness.replay`: a routing policy against simulated engines in virtual time.

`kvroute bench` runs real processes: servers, routers and a load generator, on a clock
the machine's noise reaches, at a few requests per second per core. This replays the
same seeded workload (bench/harness/workloads.py) through a policy object straight into the
simulator's own scheduler and KV cache (bench/sim/scheduler.py, kv_cache.py), one
event loop in virtual time: no sockets, no sleeps, the same result on every run, and
hundreds of requests a second of wall time, so a policy change can be judged over many
seeds, or on a fleet of a hundred backends, in seconds.

What it models: each backend's engine steps exactly as `kvroute sim` does (continuous
batching, chunked prefill, prefix cache with LRU eviction); the router's accounting as
router/dispatch/attempt.py keeps it (a request is in flight from its pick to its last token, its
uncached prompt tokens queued until its first token); multi-turn's rule that turn t is
sent once turn t-1 has finished; `--replicas` policies that each see only the load they
sent. What it leaves out: the router's own latency, HTTP, scraped metrics (`waiting` is
0), KV events (a KV_AWARE policy indexes from its own picks, as without events). So it
ranks policies; `kvroute bench` measures routers. Measured against it on long-prefix (4
backends, 150 requests, seed 0): round robin P90 3,690 ms here, 3,769 there.

    python -m bench.harness.replay --workload long-prefix --backends 4 --requests 150 --seeds 0,1,2
    python -m bench.harness.replay --workload long-prefix --requests 360 --groups 24 --tail 400

`--tail MS` counts, per run, the requests whose first token took longer than MS, by
cause (`Replay.slow_by_cause`): what a TTFT percentile on a cliff is made of.

Cost: O(engine steps x running requests), plus tokenizing each prompt once: on one
core about 650 requests a second of 1,100 tokens, 200 of 8,100 (64 backends).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from bench.harness.report import percentile
from bench.harness.workloads import SHAPES, RequestSpec, WorkloadSpec, generate
from bench.sim.kv_cache import KVCache
from bench.sim.params import SimParams
from bench.sim.request import SimRequest
from bench.sim.scheduler import Scheduler, StepPlan
from bench.sim.tokenizer import render_chat, tokenize
from hashing.canonical import Message
from policies import FleetView, Policy, RouteRequest, create, names, policy_class
from policies.registry import params_union

__all__ = ["Replay", "policy_maker", "replay"]

MODEL = "sim-llama-70b"
#: why a first token was slow (`Replay.slow_by_cause`)
CAUSES = ("cold", "own", "behind")


@dataclass(eq=False)
class _Seen:
    """A backend as one router sees it: what policies read (BackendLike)."""

    name: str
    weight: int = 1
    inflight: int = 0
    queued_tokens: int = 0
    waiting: float = 0.0


@dataclass(eq=False)
class _Engine:
    scheduler: Scheduler
    plan: StepPlan | None = None  # the step under way, if any


@dataclass(eq=False)
class _Sent:
    spec: RequestSpec
    seen: _Seen
    queued: int
    at: float


@dataclass
class Replay:
    """What one replay measured, by request index: when it was sent and finished, its
    TTFT (simulated s), the backend that served it, its group and its (prompt, cached)
    tokens; and the fleet's cache hits and requests per backend."""

    sent_at: dict[int, float] = field(default_factory=dict)
    finished_at: dict[int, float] = field(default_factory=dict)
    ttft: dict[int, float] = field(default_factory=dict)
    backend: dict[int, int] = field(default_factory=dict)
    group: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, tuple[int, int]] = field(default_factory=dict)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    served: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def spread(self) -> float:
        return max(self.served) / statistics.mean(self.served)

    def quantile_ms(self, q: float) -> float:
        return 1000 * (percentile(list(self.ttft.values()), q) or 0.0)

    def slow_by_cause(self, threshold_s: float) -> dict[str, int]:
        """The requests whose first token took longer than `threshold_s`, by why: `cold`
        (less than half its prompt was cached), `own` (sent before its group's first
        request had its first token: its prefix was still being prefilled), `behind`
        (cached, yet queued behind other prompts' prefills). A TTFT percentile that falls
        among these moves with their count, not with how the cache was used."""
        first: dict[int, int] = {}
        for i in sorted(self.sent_at, key=self.sent_at.__getitem__):
            first.setdefault(self.group[i], i)
        causes = dict.fromkeys(CAUSES, 0)
        for i, ttft in self.ttft.items():
            if ttft <= threshold_s:
                continue
            prompt, cached = self.tokens[i]
            lead = first[self.group[i]]
            if cached < prompt / 2:
                causes["cold"] += 1
            elif self.sent_at[i] < self.sent_at[lead] + self.ttft[lead]:
                causes["own"] += 1
            else:
                causes["behind"] += 1
        return causes


def replay(
    spec: WorkloadSpec,
    make_policy: Callable[[], Policy],
    backends: int,
    replicas: int = 1,
    params: SimParams | None = None,
) -> Replay:
    """Send `spec`'s requests through `replicas` policies (each request to one drawn from
    the seed) into `backends` simulated engines, until every request has its answer."""
    return _Run(spec, make_policy, backends, replicas, params or SimParams()).run()


class _Run:
    """One replay's state: the event heap, the engines, the routers' views."""

    def __init__(
        self,
        spec: WorkloadSpec,
        make_policy: Callable[[], Policy],
        backends: int,
        replicas: int,
        params: SimParams,
    ) -> None:
        self.params = params
        self.requests = generate(spec)
        self.engines = [
            _Engine(Scheduler(params, KVCache(params.num_gpu_blocks, params.block_size, True)))
            for _ in range(backends)
        ]
        self.routers = []
        for _ in range(replicas):
            seen = tuple(_Seen(f"b{i}") for i in range(backends))
            policy = make_policy()
            policy.on_fleet_change(seen)
            self.routers.append((policy, FleetView(seen, seen, frozenset(s.name for s in seen))))
        self.rng = random.Random(f"{spec.seed}/replay")
        self.heap: list[tuple[float, int, str, object]] = []
        self.order = itertools.count()
        self.sent: dict[str, _Sent] = {}
        self.finished_turn: dict[int, int] = {}
        self.held_back: dict[tuple[int, int], RequestSpec] = {}
        self.result = Replay(served=[0] * backends)

    def run(self) -> Replay:
        for req in self.requests:
            self._at(req.arrival or 0.0, "arrive", req)
        while self.heap:
            now, _, kind, what = heapq.heappop(self.heap)
            if kind == "arrive":
                self._arrive(what, now)
            else:
                self._step_ends(what, now)
        return self.result

    def _at(self, when: float, kind: str, what: object) -> None:
        heapq.heappush(self.heap, (when, next(self.order), kind, what))

    def _arrive(self, req: RequestSpec, now: float) -> None:
        if req.turn and self.finished_turn.get(req.group, -1) < req.turn - 1:
            self.held_back[(req.group, req.turn)] = req  # sent when the turn before ends
            return
        policy, view = self.routers[self.rng.randrange(len(self.routers))]
        pick = policy.pick(_describe(policy, req), view)
        seen = pick.backend
        index = int(seen.name[1:])
        ids = tokenize(render_chat(req.messages))
        sim = SimRequest(
            str(req.index),
            ids,
            max_tokens=req.max_tokens,
            limit_reason="length",
            block_size=self.params.block_size,
            model=MODEL,
            arrival=now,
        )
        queued = len(ids) - pick.predicted_cached
        seen.inflight += 1
        seen.queued_tokens += queued
        self.sent[sim.request_id] = _Sent(req, seen, queued, now)
        self.result.sent_at[req.index] = now
        self.result.backend[req.index] = index
        self.result.group[req.index] = req.group
        self.result.served[index] += 1
        self.engines[index].scheduler.add(sim)
        self._start_step(index, now)

    def _start_step(self, index: int, now: float) -> None:
        engine = self.engines[index]
        if engine.plan is not None or not engine.scheduler.has_work:
            return
        engine.plan = engine.scheduler.schedule()
        self._at(now + engine.scheduler.step_ms(engine.plan) / 1000, "step", index)

    def _step_ends(self, index: int, now: float) -> None:
        engine = self.engines[index]
        outcome = engine.scheduler.commit(engine.plan)
        engine.plan = None
        for sim in outcome.sampled:
            if sim.num_output == 1:
                self._first_token(sim, now)
        for sim in outcome.finished:
            self._finished(sim, now)
        self._start_step(index, now)

    def _first_token(self, sim: SimRequest, now: float) -> None:
        sent = self.sent[sim.request_id]
        self.result.ttft[sent.spec.index] = now - sent.at
        self.result.tokens[sent.spec.index] = (sim.prompt_len, sim.num_cached_tokens)
        self.result.cached_tokens += sim.num_cached_tokens
        self.result.prompt_tokens += sim.prompt_len
        sent.seen.queued_tokens -= sent.queued

    def _finished(self, sim: SimRequest, now: float) -> None:
        sent = self.sent.pop(sim.request_id)
        sent.seen.inflight -= 1
        spec = sent.spec
        self.result.finished_at[spec.index] = now
        self.finished_turn[spec.group] = spec.turn
        follower = self.held_back.pop((spec.group, spec.turn + 1), None)
        if follower is not None:
            self._arrive(follower, now)


def _describe(policy: Policy, req: RequestSpec) -> RouteRequest:
    """The RouteRequest the router would build for this chat (router/dispatch/describe.py)."""
    messages = msgspec.convert(req.messages, list[Message])
    fingerprint, blocks, tokens = 0, (), 0
    if policy.fingerprinter is not None:
        fingerprint = policy.fingerprinter.chat(MODEL, None, messages, None)
    if policy.block_keys is not None:
        blocks, tokens = policy.block_keys.chat(MODEL, None, messages)
    return RouteRequest(MODEL, fingerprint, blocks, tokens)


def policy_maker(strategy: str, seed: int) -> Callable[[], Policy]:
    """Each replica's policy of `strategy`, seeded with the workload's seed if it draws."""
    fields = {"strategy": strategy}
    if "seed" in policy_class(strategy).params_type.__struct_fields__:
        fields["seed"] = seed
    params = msgspec.convert(fields, params_union())
    return lambda: create(params)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.harness.replay", description=__doc__)
    parser.add_argument("--workload", choices=sorted(SHAPES), default="long-prefix")
    parser.add_argument("--strategies", default="KV_AWARE,PREFIX_AWARE,ROUND_ROBIN")
    parser.add_argument("--backends", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--groups", type=int, default=50)
    parser.add_argument("--rate", type=float, default=6.0, help="arrivals per simulated s")
    parser.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1,2")
    parser.add_argument(
        "--tail",
        type=float,
        metavar="MS",
        help="also count the requests whose TTFT passed MS simulated ms, by cause: cold "
        "(under half the prompt cached), own (its prefix still being prefilled for an "
        "earlier request of its group), behind (cached, queued behind other prefills)",
    )
    args = parser.parse_args(argv)
    strategies = [s.strip().upper() for s in args.strategies.split(",")]
    unknown = [s for s in strategies if s not in names()]
    if unknown:
        parser.error(f"unknown strategies {unknown}; known: {', '.join(names())}")
    seeds = [int(s) for s in args.seeds.split(",")]
    tail = "" if args.tail is None else f"  over {args.tail:g} ms: " + " / ".join(CAUSES)
    print(f"{'strategy':28} {'p50 ms':>8} {'p90':>8} {'p99':>8} {'KV hit':>7} {'spread':>7}{tail}")
    for strategy in strategies:
        runs = [
            replay(
                WorkloadSpec(
                    shape=args.workload,
                    requests=args.requests,
                    groups=args.groups,
                    rate=args.rate,
                    seed=seed,
                ),
                policy_maker(strategy, seed),
                args.backends,
                args.replicas,
            )
            for seed in seeds
        ]
        cells = [statistics.mean(r.quantile_ms(q) for r in runs) for q in (0.5, 0.9, 0.99)]
        hit = statistics.mean(r.hit_rate for r in runs)
        spread = statistics.mean(r.spread for r in runs)
        row = (
            f"{strategy:28} {cells[0]:8.0f} {cells[1]:8.0f} {cells[2]:8.0f}"
            f" {hit:7.1%} {spread:7.2f}"
        )
        if args.tail is not None:
            slow = [r.slow_by_cause(args.tail / 1000) for r in runs]
            means = [statistics.mean(s[c] for s in slow) for c in CAUSES]
            row += "  " + " / ".join(f"{m:.1f}" for m in means)
        print(row)
    print(f"means over seeds {args.seeds}; {args.backends} backends, {args.replicas} replicas")
    if args.tail is not None:
        print("over MS: requests a run whose TTFT passed it: cold / own / behind (--help)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
