"""What each backend proved it holds: the answers' cached-token counts correct the index.

Without KV events the prefix index (hashing/prefix_index.py) believes every placement the
router made until its TTL or its capacity runs out, and an engine with a small cache (two
prompt slots) keeps far less. Each answer says how many of its prompt's tokens the backend
found cached (vLLM's `usage.prompt_tokens_details.cached_tokens`); `CacheTrust.observe`
turns that, in blocks, against what the index predicted, into:

- a correction. A *miss* (fewer blocks than predicted, by more than one and more than an
  eighth: an engine may recompute the last block of a prompt it holds whole, and a
  tokenizer that only approximates the engine's counts tokens apart) drops the prompt's
  blocks past what the backend had from its speculative entries: its cache turns over
  faster than the index assumed, so they are credited again only once the router sends
  them there anew. A *hit* refreshes the blocks it had (their TTL, and their place in the
  index's LRU order), as the engine's own LRU did. A *surplus* (more than predicted) puts
  back what the index had let go.
- a learned capacity, in blocks: how many speculative blocks of the backend the index keeps
  (`PrefixIndex.trust`, least recently used out first). Every answer also says how many
  blocks the backend had to insert (the prompt's blocks it did not have), so the router
  counts the backend's insertions; a speculative entry's expiry, less its TTL, says when
  its block was last used there. A cache that lost a block after N insertions since its
  last use holds fewer than N blocks: a miss lowers the capacity to N (never below the
  prompt, which it just ran). A surplus (a hit on blocks the index no longer trusted)
  raises it by the blocks beyond the prediction, unless the index dropped them at a
  recent miss (the engine kept what that miss's request computed anew). A hit that was
  predicted proves less (an engine keeps a prefix in use however full it is) and only
  refreshes. Each answer moves
  the capacity by at most half (down) or double (up), so one outlier (a restart that
  emptied the cache) cannot swing it. An engine that keeps two prompts ends up trusted
  for about two.

With KV events the index holds what the backend said, and an answer is a cross-check: a
miss or a surplus is a disagreement (counted by the caller). When no event batch came for
`EVENTS_STALL_S` the events are taken to have stalled, and a miss drops the blocks past
what the backend had from its confirmed entries too. The capacity is learned only from
speculative entries.

Pure and single-threaded, as the index: one event loop owns it. Cost per answer: O(blocks
it had) dictionary moves for a hit's refresh, O(log history) for a miss's insertion count.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from hashing.prefix_index import PrefixIndex

__all__ = ["EVENTS_STALL_S", "Answer", "CacheTrust", "Learned", "Lesson", "Outcome", "judged"]

#: a backend's KV events count as stalled once none came for this long (seconds)
EVENTS_STALL_S = 10.0
#: blocks a report may differ from the prediction by and still be a hit: one (an engine
#: may recompute the last block of a prompt it holds whole), or an eighth of the
#: prediction (a tokenizer that only approximates the engine's counts tokens apart)
_SLACK = 1
_SLACK_SHARE = 1 / 8
#: one answer moves the bound by at most this factor, either way
_STEP = 2.0
#: answers remembered per backend to date a block's last use in insertions
_HISTORY = 4096
#: recent misses remembered per backend, so their prompts' next run is no surplus
_DROPPED = 256


class Outcome(StrEnum):
    HIT = "hit"
    MISS = "miss"
    SURPLUS = "surplus"
    COLD = "cold"


def judged(predicted: int, reported: int) -> Outcome:
    """An answer's outcome from its predicted and reported cached blocks."""
    slack = max(_SLACK, int(predicted * _SLACK_SHARE))
    if reported + slack < predicted:
        return Outcome.MISS
    if reported > predicted + slack:
        return Outcome.SURPLUS
    return Outcome.HIT if predicted else Outcome.COLD


class Answer(NamedTuple):
    """One answer as every process applies it (router/fleet/placements.py sends it)."""

    backend: str
    #: the prompt's block keys
    keys: Sequence[int]
    #: cached blocks, as the index predicted and as the backend reported
    predicted: int
    reported: int
    #: when it came (time.monotonic), and the TTL of the backend's speculative entries
    at: float
    ttl: float
    #: the backend's KV events stalled: its confirmed entries are corrected too
    confirmed: bool = False
    #: of a miss, as the index stood when the answer came (`CacheTrust.witnessed`): when
    #: the first lost block's speculative entry expired (None: it had none), and how many
    #: speculative keys the backend had. Every process then learns alike, even where
    #: another one's correction of a shared index came first
    expires_at: float | None = None
    held: int | None = None

    @property
    def lesson(self) -> Lesson:
        """What the answer teaches apart from its corrections of the index."""
        keys, predicted, reported = self.keys, self.predicted, self.reported
        edge = min(predicted, reported)
        return Lesson(
            self.backend,
            len(keys),
            predicted,
            reported,
            self.at,
            self.ttl,
            keys[edge] if edge < len(keys) else 0,
            self.expires_at,
            self.held,
        )


class Lesson(NamedTuple):
    """An answer's learning without its keys: all a process applies whose index another
    one already corrected (one index shared by the host's processes), a few numbers in
    place of a long prompt's thousands of keys."""

    backend: str
    #: the prompt's blocks
    blocks: int
    predicted: int
    reported: int
    at: float
    ttl: float
    #: the prompt's key where prediction and report part: a miss's first lost block, a
    #: surplus's first block the index had not predicted (0 when they do not part)
    edge: int
    #: as `Answer`'s (a miss's, witnessed)
    expires_at: float | None
    held: int | None


@dataclass(slots=True)
class Learned:
    """One backend's learned capacity (None: nothing learned, the index's capacity holds),
    the answers that taught it, and its insertions: in all, and at each recent answer."""

    blocks: float | None = None
    hits: int = 0
    misses: int = 0
    surpluses: int = 0
    inserted: int = 0
    times: deque[float] = field(default_factory=lambda: deque(maxlen=_HISTORY))
    counts: deque[int] = field(default_factory=lambda: deque(maxlen=_HISTORY))
    #: the first block of each recent miss's dropped blocks, oldest first
    dropped: dict[int, bool] = field(default_factory=dict)

    def since(self, at: float) -> int:
        """Blocks inserted since `at` (since the oldest answer remembered, if before)."""
        i = bisect_right(self.times, at)
        return self.inserted - (self.counts[i - 1] if i else self.counts[0] if self.counts else 0)

    def described(self) -> dict[str, int | None]:
        blocks = None if self.blocks is None else int(self.blocks)
        return {
            "blocks": blocks,
            "hits": self.hits,
            "misses": self.misses,
            "surpluses": self.surpluses,
        }


class CacheTrust:
    def __init__(self, index: PrefixIndex) -> None:
        self._index = index
        self.learned: dict[str, Learned] = {}
        #: when each backend's last KV event batch arrived (time.monotonic)
        self.heard: dict[str, float] = {}

    def stalled(self, backend: str, now: float) -> bool:
        """The backend's KV events stopped coming (or never came)."""
        return now - self.heard.get(backend, float("-inf")) > EVENTS_STALL_S

    def witnessed(self, answer: Answer) -> Answer:
        """`answer` with what a miss's learning reads of the index, read now (by the
        process the answer came to, before anything corrects the index)."""
        if judged(answer.predicted, answer.reported) is not Outcome.MISS:
            return answer
        index, backend = self._index, answer.backend
        expires_at = index.expiry(backend, answer.keys[answer.reported])
        return answer._replace(expires_at=expires_at, held=index.size(backend)[1])

    def observe(self, answer: Answer) -> Outcome:
        """Apply one answer: correct the index, then learn (see the module's docstring)."""
        backend, keys, predicted, reported, at, ttl = answer[:6]
        outcome = judged(predicted, reported)
        index = self._index
        if outcome is Outcome.MISS:
            if answer.held is None:
                answer = self.witnessed(answer)
            index.dropped(backend, keys[reported:], answer.confirmed)
        elif outcome is Outcome.SURPLUS:
            index.learn(backend, keys[:reported], at + ttl)
        elif outcome is Outcome.HIT:
            index.touched(backend, keys[:reported], at + ttl)
        self.learn(answer.lesson)
        return outcome

    def learn(self, lesson: Lesson) -> None:
        """The backend's counts and learned capacity from one answer (its corrections of
        the index are `observe`'s)."""
        outcome = judged(lesson.predicted, lesson.reported)
        learned = self.learned.setdefault(lesson.backend, Learned())
        if outcome is Outcome.MISS:
            learned.misses += 1
            self._missed(lesson, learned)
        elif outcome is Outcome.SURPLUS:
            learned.surpluses += 1
            rerun = learned.dropped.pop(lesson.edge, False)
            if learned.blocks is not None and not rerun:
                gained = lesson.reported - lesson.predicted
                self._bound(lesson.backend, learned, learned.blocks + gained)
        elif outcome is Outcome.HIT:
            learned.hits += 1
        learned.inserted += lesson.blocks - lesson.reported
        learned.times.append(lesson.at)
        learned.counts.append(learned.inserted)

    def _missed(self, lesson: Lesson, learned: Learned) -> None:
        """The backend lost the prompt's blocks from `reported` on: fewer than the blocks
        inserted there since the first of them was last used fit in its cache."""
        learned.dropped[lesson.edge] = True
        if len(learned.dropped) > _DROPPED:
            del learned.dropped[next(iter(learned.dropped))]
        if lesson.expires_at is None:
            return
        fits = max(learned.since(lesson.expires_at - lesson.ttl), lesson.blocks)
        if learned.blocks is None:  # it held no more than the index did
            learned.blocks = max(lesson.held or 0, fits)
        self._bound(lesson.backend, learned, min(learned.blocks, fits))

    def _bound(self, backend: str, learned: Learned, blocks: float) -> None:
        """Set the learned capacity, moved at most `_STEP`-fold from where it was."""
        if learned.blocks is not None:
            blocks = min(max(blocks, learned.blocks / _STEP), learned.blocks * _STEP)
        learned.blocks = blocks
        self._index.trust(backend, int(blocks))

    def forget(self, backend: str) -> None:
        """The backend left the fleet."""
        self.learned.pop(backend, None)
        self.heard.pop(backend, None)
