"""The engine of one simulated server: an asyncio step loop around the scheduler.

Loop: schedule a step, publish the KV events it produced (vLLM publishes at schedule
time), sleep until the step's deadline (previous deadline, or now if idle or late, plus
the simulated duration x time_scale x slow-fault factor; the Python work of the step
happens inside that time), then commit: sampled
tokens wake their HTTP handlers, finished requests free their blocks, metrics and stats
are recorded. With no work the loop awaits an Event: an idle backend costs nothing.

Invariant: each request is in exactly one of waiting / running / finished; only the
loop, `submit`, `abort` and `restart` move it, all on the event loop thread.
`stats` are the simulator's own totals for benchmarks and survive restarts; the
Prometheus metrics start over on restart like a new vLLM process.

Tokens read from a remote prefill count as vLLM counts a connector's tokens: in the
request's `num_cached_tokens` (hence usage's cached_tokens, as vLLM sets it from local
plus external computed tokens), in `vllm:external_prefix_cache_hits`, and in the
`kv_transfer_tokens` stat; not in `vllm:prefix_cache_hits`. The external counters run
on a server with a connector: a CPU tier, a P/D role, or a request decoding from a
remote prefill.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec

from bench.sim.kv_cache import KVCache
from bench.sim.metrics import SimMetrics
from bench.sim.params import SimParams, scaled_seconds
from bench.sim.publisher import KVEventPublisher
from bench.sim.request import SimRequest
from bench.sim.scheduler import Scheduler, StepOutcome, StepPlan


class EngineStats(msgspec.Struct):
    requests_received: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0  # the client went away
    requests_dropped: int = 0  # killed by a restart or stop
    prefix_cache_queries: int = 0  # prompt tokens looked up on first admission
    prefix_cache_hits: int = 0  # of which were served from the prefix cache
    cpu_hit_tokens: int = 0  # of the others, loaded from the CPU tier
    kv_transfer_tokens: int = 0  # of the others, read from a remote prefill instance
    prefills_for_remote_decode: int = 0  # requests with do_remote_decode
    decodes_from_remote_prefill: int = 0  # requests with do_remote_prefill
    plain_requests_on_pd_role: int = 0  # no transfer, on a prefill- or decode-only server
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    busy_seconds: float = 0.0  # sum of step durations (wall-clock, i.e. scaled)
    busy_sim_ms: float = 0.0  # the same in simulated ms (not scaled by time_scale)
    prefill_sim_ms: float = 0.0  # of which, steps that prefilled prompt tokens


class SimEngine:
    def __init__(self, params: SimParams, publisher: KVEventPublisher | None = None) -> None:
        self.params = params
        self.publisher = publisher
        self.stats = EngineStats()
        self.slow_factor = 1.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._reset_state()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._drop_all()

    def submit(self, req: SimRequest) -> None:
        st = self.stats
        st.requests_received += 1
        if req.remote_decode:
            st.prefills_for_remote_decode += 1
        elif req.remote_prefill:
            st.decodes_from_remote_prefill += 1
        elif self.params.kv_role != "both":
            st.plain_requests_on_pd_role += 1
        self.scheduler.add(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """The client disconnected: free the request's work (no-op once finished)."""
        if req.finished:
            return
        self.scheduler.abort(req)
        self.stats.requests_aborted += 1
        self.metrics.success["abort"].inc()
        self._set_gauges()  # the loop may now idle: do not leave the last step's values

    def restart(self) -> None:
        """Simulate a process restart: in-flight requests die, cache/metrics/seq reset."""
        self._drop_all()
        self._reset_state()
        if self.publisher is not None:
            self.publisher.reset()

    async def reset_prefix_cache(self) -> bool:
        """vLLM's POST /reset_prefix_cache: False (and no change) while blocks are in use."""
        done = self.kv.reset_prefix_cache()
        await self._publish()
        return done

    def _reset_state(self) -> None:
        p = self.params
        self.kv = KVCache(p.num_gpu_blocks, p.block_size, p.enable_prefix_caching, p.num_cpu_blocks)
        self.scheduler = Scheduler(p, self.kv)
        self.metrics = SimMetrics(p)

    def _drop_all(self) -> None:
        for req in self.scheduler.drain():
            req.dropped = True
            self.stats.requests_dropped += 1
            req.on_update()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not self.scheduler.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            scheduler = self.scheduler  # a restart during the sleep swaps it
            plan = scheduler.schedule()
            await self._publish()
            step_ms = scheduler.step_ms(plan) * self.slow_factor
            duration = scaled_seconds(self.params, step_ms)
            # Deadlines accumulate across back-to-back steps, so steps shorter than the
            # loop's timer resolution (1 ms on uvloop) still add up to the right wall time;
            # after idling or falling behind, the next step starts from now.
            deadline = max(deadline, loop.time()) + duration
            await asyncio.sleep(deadline - loop.time())
            outcome = scheduler.commit(plan)
            self.stats.steps += 1
            self.stats.busy_seconds += duration
            self.stats.busy_sim_ms += step_ms
            if plan.prefill_tokens:
                self.stats.prefill_sim_ms += step_ms
            self._account(plan, outcome, loop.time())

    async def _publish(self) -> None:
        events = self.kv.take_events()
        if events and self.publisher is not None:
            await self.publisher.publish(events)

    def _account(self, plan: StepPlan, outcome: StepOutcome, now: float) -> None:
        m, st, p = self.metrics, self.stats, self.params
        connector = p.num_cpu_blocks > 0 or p.kv_role != "both"
        for req in plan.admitted:  # a first admission looks up exactly the prompt
            external = req.num_loaded_tokens + req.num_transferred_tokens
            hits = req.num_cached_tokens - external
            m.prefix_queries.inc(req.prompt_len)
            m.prefix_hits.inc(hits)
            st.prefix_cache_queries += req.prompt_len
            st.prefix_cache_hits += hits
            st.cpu_hit_tokens += req.num_loaded_tokens
            st.kv_transfer_tokens += req.num_transferred_tokens
            if connector or req.remote_prefill:  # the connector is asked what the GPU missed
                m.external_queries.inc(req.prompt_len - hits)
                m.external_hits.inc(external)
        m.preemptions.inc(plan.num_preempted)
        st.preemptions += plan.num_preempted
        for req in outcome.sampled:
            self._record_token(req, now)
        m.generation_tokens.inc(len(outcome.sampled))
        st.generation_tokens += len(outcome.sampled)
        for req in outcome.finished:
            m.e2e.observe(now - req.arrival)
            m.success[req.finish_reason or "stop"].inc()
            st.requests_finished += 1
        self._set_gauges()

    def _set_gauges(self) -> None:
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self.metrics.kv_usage.set(self.kv.usage)

    def _record_token(self, req: SimRequest, now: float) -> None:
        if req.first_token_at is None:
            req.first_token_at = now
            self.metrics.ttft.observe(now - req.arrival)
            self.metrics.prompt_tokens.inc(req.prompt_len)
            self.stats.prompt_tokens += req.prompt_len
        else:
            self.metrics.itl.observe(now - req.last_token_at)
        req.last_token_at = now
        req.on_update()


async def updates(req: SimRequest) -> AsyncIterator[int]:
    """Yield the request's output length each time it grows, until it finishes.

    Tokens produced while the consumer was busy arrive together, as vLLM's output
    collector merges them for a slow reader.
    """
    event = asyncio.Event()
    req.on_update = event.set
    sent = 0
    while not req.finished:
        await event.wait()
        event.clear()
        if req.num_output > sent:
            sent = req.num_output
            yield sent
