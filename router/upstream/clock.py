"""A body's clock: when its first chunk came, the gaps between chunks, the idle deadline.

Kept apart from the reading so that the three ways of reading a body (whole, chunk by
chunk, relayed from the connection's callbacks) share one account of it.

Two clocks: chunks are stamped with `time.perf_counter()`, since the event loop's clock
ticks in milliseconds on uvloop (an inter-token gap or a cached prompt's first token
can be shorter); the idle deadline is kept on the loop's clock, which its timer and the
exchange's end read, converted once per idle timer from the time left since the last
chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from time import perf_counter

from prometheus_client import Histogram

from router.metrics import Tally

_TAIL_MIN = 32  # bytes: shorter chunks (`data: [DONE]`, framed or not) hold no usage


class Framed(bytes):
    """A kept read of whole chunks, still in chunked framing."""


def _came() -> None:
    """`on_first` once it was called or the exchange ended."""


class BodyClock:
    """Times one body's chunks; `tail` keeps the last chunk long enough to hold usage.

    `on_first` (the attempt's, which holds the upstream that holds this clock) is let go
    once called or once the exchange ended: the cycle would otherwise keep each request's
    objects, its body and block keys among them, for a garbage-collector pass, which then
    frees those of hundreds of requests at once, on the event loop (~10 ms with new
    100k-token prompts flowing), instead of each as its request ends."""

    __slots__ = (
        "_deadline",
        "_end",
        "_idle",
        "_idle_timer",
        "_itl",
        "_last_chunk_at",
        "_loop",
        "_on_first",
        "_second_chunk_at",
        "_tally",
        "chunks",
        "first_chunk_at",
        "kept",
        "tail",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        idle: float,
        end: float,
        itl: Histogram,
        on_first: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._idle = idle
        self._end = end
        self._itl = itl
        self._on_first = on_first
        self._deadline: asyncio.Timeout | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._tally: Tally | None = None
        self._last_chunk_at = 0.0
        self._second_chunk_at: float | None = None
        self.first_chunk_at: float | None = None
        #: chunks that came (a stream's events, about one a token)
        self.chunks = 0
        self.tail = b""
        #: every chunk, when the answer is captured (router/capture.py); else None
        self.kept: list[bytes] | None = None

    def watch(self, deadline: asyncio.Timeout) -> None:
        """The timeout guarding the body; once chunks flow, it expires `idle` seconds
        after the last one (and at `end` at the latest)."""
        self._deadline = deadline

    def begin(self) -> None:
        """The body is about to be read chunk by chunk: its gaps are tallied."""
        assert self._deadline is not None, "watch() the body's timeout before reading it"
        self._tally = Tally(self._itl)

    def arrived(self, chunk: bytes, framed: bool = False) -> None:
        """A chunk came now: the first one ends the prefill, any other one a gap.
        `framed`: it is whole chunks as the backend framed them (the relay's direct
        reads), which a kept body decodes when it is read (`Framed`)."""
        now = perf_counter()
        self.chunks += 1
        if self.first_chunk_at is None:
            self.first_chunk_at = now
            self._on_first()
            self._on_first = _came
            self._deadline.reschedule(None)  # the idle timer decides from here on
            self._arm_idle_timer(self._idle)
        else:
            self._tally.observe(now - self._last_chunk_at)
            if self.chunks == 2:
                self._second_chunk_at = now
        self._last_chunk_at = now
        if len(chunk) > _TAIL_MIN:
            self.tail = chunk
        if self.kept is not None:
            self.kept.append(Framed(chunk) if framed else chunk)

    def decoding(self) -> tuple[int, float]:
        """The chunks after the first and the seconds they took (0, 0.0 before any)."""
        if self.first_chunk_at is None:
            return 0, 0.0
        return self.chunks - 1, self._last_chunk_at - self.first_chunk_at

    def second_chunk(self) -> float | None:
        """Seconds from the first chunk to the second (None before it). Gaps timed from
        the second are one a decode step: a chat stream's first two events (its role,
        its first token) come together, in one read or two."""
        second = self._second_chunk_at
        return None if second is None else second - self.first_chunk_at

    def stop(self) -> None:
        """The exchange ended: no more deadline, and the gaps go to the histogram."""
        self._on_first = _came
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._tally is not None:
            self._tally.flush()

    def _arm_idle_timer(self, left: float) -> None:
        """Expire the body's timeout `left` seconds from now (never after `end`) unless a
        chunk comes.

        A chunk only notes its time: this one timer wakes at the deadline it was set for and,
        if a chunk came since, sleeps on until the new one. So a stream costs a timer per
        idle period, not a reschedule (a timer cancelled and another created) per chunk.
        """
        loop = self._loop
        now = loop.time()
        due = min(now + left, self._end)
        if due > now:
            self._idle_timer = loop.call_at(due, self._on_idle_timer)
        else:
            self._idle_timer = None
            self._deadline.reschedule(due)  # not in the future: asyncio's timeout expires now

    def _on_idle_timer(self) -> None:
        self._arm_idle_timer(self._last_chunk_at + self._idle - perf_counter())
