"""Each answer's reported cached tokens, into the KV-aware policy's index, in every worker.

The request path hands every answer's `cached_tokens` here with the prediction its pick
made (router/dispatch/prediction.py). Against a backend without KV events it corrects the
index and the backend's learned capacity (hashing/cache_trust.py; a cold answer too: the
blocks it inserted count), in this process at once and, with several workers, in the
others through the placements' broadcast
(router/fleet/placements.py `answered`; `adopt` applies theirs), or, where the workers
share one index, as its `Lesson` (`taught`; `learn` applies theirs). Against a backend with
events it is a cross-check: a miss or a surplus counts as a disagreement, and corrects the
index only once the backend's events stalled.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from hashing.cache_trust import Answer, Lesson, Outcome, judged
from hashing.tiered_index import TieredIndex
from router.fleet.backends import Fleet
from router.metrics import Metrics

__all__ = ["CacheFeedback", "in_router_tokens"]

#: the outcomes where the index was wrong
_WRONG = (Outcome.MISS, Outcome.SURPLUS)


def in_router_tokens(cached: int, prompt: int, reported_prompt: int | None) -> int:
    """A backend's cached tokens counted as the router counts the prompt (`prompt`): the
    same share of it. A tokenizer that only approximates the engine's (`chatml4` before
    llama.cpp) counts the prompt apart; an exact one (`hf`, `backend`) changes nothing."""
    if not reported_prompt or not prompt or reported_prompt == prompt:
        return cached
    return min(prompt, cached * prompt // reported_prompt)


class CacheFeedback:
    __slots__ = ("_fleet", "_metrics")

    def __init__(self, fleet: Fleet, metrics: Metrics) -> None:
        self._fleet = fleet
        self._metrics = metrics

    def answered(self, backend: str, keys: Sequence[int], predicted: int, reported: int) -> None:
        """One answer of `backend` to a prompt of block `keys`: `predicted` and `reported`
        cached prompt tokens."""
        policy = self._fleet.policy
        index = getattr(policy, "index", None)
        if index is None or not keys:
            return
        p = policy.params
        size = p.block_size
        predicted, reported = min(predicted // size, len(keys)), min(reported // size, len(keys))
        outcome = judged(predicted, reported)
        events = backend in policy.event_backends
        now = time.monotonic()
        if events and outcome in _WRONG:
            self._metrics.kv_disagreements.labels(backend).inc()
        if events and not index.trust.stalled(backend, now):
            return
        if outcome in _WRONG:
            self._metrics.kv_corrections.labels(backend, outcome.value).inc()
        ttl = p.speculative_ttl_s if events else p.approximate_ttl_s
        answer = index.trust.witnessed(
            Answer(backend, list(keys), predicted, reported, now, ttl, events)
        )
        self.adopt(answer)
        placements = self._fleet.placements
        if placements is None:
            return
        if index.shared:  # the other workers' index is this one, corrected already
            placements.taught(answer.lesson)
            return
        if outcome is Outcome.MISS:
            placements.dropped(backend, keys[reported:])
        placements.answered(answer)

    def adopt(self, answer: Answer) -> None:
        """Apply an answer (this worker's or another's) to the index and show the
        backend's learned capacity."""
        index = getattr(self._fleet.policy, "index", None)
        if index is not None:
            index.trust.observe(answer)
            self._show(index, answer.backend)

    def learn(self, lesson: Lesson) -> None:
        """Learn from another worker's answer, whose correction of the shared index is
        made already."""
        index = getattr(self._fleet.policy, "index", None)
        if index is not None:
            index.trust.learn(lesson)
            self._show(index, lesson.backend)

    def _show(self, index: TieredIndex, backend: str) -> None:
        learned = index.trust.learned[backend].blocks
        if learned is not None:
            self._metrics.learned_cache_blocks.labels(backend).set(int(learned))
