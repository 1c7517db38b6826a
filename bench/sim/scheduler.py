"""Continuous batching: vLLM V1's scheduler loop and the simulator's step-time model.

Each engine step (`schedule`, then the step's duration passes, then `commit`):
1. Running requests first, in admission order. Each asks for all its uncomputed tokens
   (the prompt remainder while prefilling, 1 while decoding), capped by the step's token
   budget (`max_num_batched_tokens`: chunked prefill). If its KV blocks cannot be
   allocated, the most recently admitted running request is preempted (recompute mode:
   its blocks are freed, its progress reset, it goes back to the head of the queue) until
   the allocation fits or the request preempted itself.
2. If nothing was preempted, waiting requests are admitted FCFS while budget remains and
   fewer than `max_num_seqs` run. A newly admitted request first takes its prefix-cache
   hit, so only uncached tokens use budget; if its blocks do not fit, admission stops.
   With a CPU tier, the blocks it holds right after the hit are loaded, not prefilled.
   A request decoding from a remote prefill has, on its first admission, every prompt
   token after the hit but the last read from the remote instance: they are computed
   without using budget, and only the last prompt token is prefilled (vLLM's consumer).
3. After the step, every request whose computed tokens reached its length samples one
   token; a request that reached `max_tokens` finishes and frees its blocks.

Step time (simulated ms) = step_base_ms + decode_per_seq_ms * decoding requests
+ prefill_per_token_ms * prefill tokens (recomputed tokens after a preemption count as
prefill) + cpu_load_per_token_ms * tokens loaded from the CPU tier, all divided by the
instance's `speed`. Prefix-cache hits cost
nothing, so TTFT grows with uncached prompt tokens and
with the queue ahead. Cost of a step: O(running + admitted) Python work.
"""

from collections import deque
from typing import NamedTuple

from bench.sim.kv_cache import KVCache
from bench.sim.params import SimParams
from bench.sim.request import FinishReason, SimRequest, Status


class StepPlan(NamedTuple):
    scheduled: list[tuple[SimRequest, int]]  # (request, tokens computed this step)
    admitted: list[SimRequest]  # first admissions: their prefix-cache query is counted
    num_preempted: int
    prefill_tokens: int
    decode_seqs: int
    loaded_tokens: int = 0  # of the scheduled prompt tokens, loaded from the CPU tier
    transferred_tokens: int = 0  # read from remote prefills (not among the scheduled ones)


class StepOutcome(NamedTuple):
    sampled: list[SimRequest]  # got one new output token
    finished: list[SimRequest]


class Scheduler:
    def __init__(self, params: SimParams, kv: KVCache) -> None:
        self.params = params
        self.kv = kv
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: SimRequest) -> None:
        self.waiting.append(req)

    def abort(self, req: SimRequest) -> None:
        """Remove an unfinished request and free its blocks (client went away)."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.kv.free(req)
        self._finish(req, "abort")

    def drain(self) -> list[SimRequest]:
        """Finish every request as aborted, as a dying server does; return them."""
        dropped = [*self.running, *self.waiting]
        for req in dropped:
            self.abort(req)
        return dropped

    def schedule(self) -> StepPlan:
        budget = self.params.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        preempted: list[SimRequest] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._fit(req, num_new, preempted):
                break
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        admitted, loaded, transferred = ([], 0, 0) if preempted else self._admit(budget, scheduled)
        return self._plan(scheduled, admitted, len(preempted), loaded, transferred)

    def step_ms(self, plan: StepPlan) -> float:
        p = self.params
        work = (
            p.step_base_ms
            + p.decode_per_seq_ms * plan.decode_seqs
            + p.prefill_per_token_ms * plan.prefill_tokens
            + p.cpu_load_per_token_ms * plan.loaded_tokens
            + p.kv_transfer_per_token_ms * plan.transferred_tokens
        )
        return work / p.speed

    def commit(self, plan: StepPlan) -> StepOutcome:
        sampled: list[SimRequest] = []
        finished: list[SimRequest] = []
        for req, num_new in plan.scheduled:
            if req.finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += num_new
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk: no token yet
            req.append_output_token()
            sampled.append(req)
            if req.num_output >= req.max_tokens:
                self.running.remove(req)
                if req.remote_decode:  # what the decode instance will read
                    req.remote_block_ids = req.blocks[: req.prompt_len // self.kv.block_size]
                self.kv.free(req)
                self._finish(req, req.limit_reason)
                finished.append(req)
        return StepOutcome(sampled, finished)

    def _admit(
        self, budget: int, scheduled: list[tuple[SimRequest, int]]
    ) -> tuple[list[SimRequest], int, int]:
        """Admit waiting requests; returns them, the tokens they load from the CPU and
        those they read from remote prefills."""
        admitted: list[SimRequest] = []
        loaded_total = transferred_total = 0
        bs = self.kv.block_size
        while self.waiting and budget > 0 and len(self.running) < self.params.max_num_seqs:
            req = self.waiting[0]
            computed = self.kv.computed_blocks(req)
            hit = len(computed) * bs
            first = req.num_cached_tokens < 0
            remote = req.prompt_len - 1 - hit if req.remote_prefill and first else 0
            num_new = min(req.num_tokens - hit - remote, budget)
            if not self.kv.allocate(req, remote + num_new, computed):
                break
            loaded = 0 if remote else min(self.kv.offloaded(req, len(computed)) * bs, num_new)
            self.waiting.popleft()
            req.num_computed_tokens = hit + remote
            req.status = Status.RUNNING
            self.running.append(req)
            if first:
                req.num_cached_tokens = req.num_computed_tokens + loaded
                req.num_loaded_tokens = loaded
                req.num_transferred_tokens = remote
                admitted.append(req)
            scheduled.append((req, num_new))
            budget -= num_new
            loaded_total += loaded
            transferred_total += remote
        return admitted, loaded_total, transferred_total

    def _fit(self, req: SimRequest, num_new: int, preempted: list[SimRequest]) -> bool:
        """Allocate for a running request, preempting from the back; False if it was itself."""
        while not self.kv.allocate(req, num_new, []):
            victim = self._preempt_last()
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt_last(self) -> SimRequest:
        victim = self.running.pop()
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        return victim

    def _plan(
        self,
        scheduled: list[tuple[SimRequest, int]],
        admitted: list[SimRequest],
        preempted: int,
        loaded: int,
        transferred: int,
    ) -> StepPlan:
        decode_seqs = sum(1 for req, n in scheduled if _is_decode(req, n))
        prefill = sum(n for req, n in scheduled if not _is_decode(req, n)) - loaded
        return StepPlan(scheduled, admitted, preempted, prefill, decode_seqs, loaded, transferred)

    @staticmethod
    def _finish(req: SimRequest, reason: FinishReason) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason


def _is_decode(req: SimRequest, num_new: int) -> bool:
    """One token after the whole prompt: a decode step (a recompute counts as prefill)."""
    return num_new == 1 and req.num_computed_tokens >= req.prompt_len
