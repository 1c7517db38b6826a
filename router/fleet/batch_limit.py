"""How many requests a backend runs at once, learned from its scraped
`vllm:num_requests_running` and `vllm:num_requests_waiting`, so that flow control can
tell a full backend by the router's own in-flight count, which is exact and current,
instead of by a scrape that is up to one interval old.

vLLM admits a new request at its next engine step, so a scrape often finds one waiting
beside a batch with room, and a batch still filling shows requests waiting at each size
it passes. Two scrapes in a row that find requests waiting, the second running no more
than the first, find the batch at its limit: the limit is then the most it ran lately
(`peak`, over the last 10-20 s), since a batch never runs more than its limit (vLLM's
`max_num_seqs`, or fewer when the KV cache binds first) and a full one runs exactly
that. A scrape that finds more running than the limit, nothing waiting, shows room: the
limit is that count. One that finds it running at the limit with nothing waiting
confirms it; held there by the router (`max_waiting` 0 lets nothing more through), the
limit is raised by a tenth (at least one) every `PROBE_SECONDS` to find room that
appeared (a limit learned low, or a KV cache that binds less): the requests sent on the
raise wait in vLLM's queue until the next two scrapes take it back. A limit is kept
while the backend runs below it (it binds only at the limit, where it is checked again),
and forgotten when its metrics go stale (it may have restarted).
"""

from __future__ import annotations

import math
import time

#: the peak's window, seconds
WINDOW_SECONDS = 10.0
#: a backend held at its limit has it raised this often, seconds
PROBE_SECONDS = 10.0


class BatchLimit:
    """One backend's learned limit of running requests (`slots`, None while unknown)."""

    __slots__ = (
        "_bucket",
        "_others_then",
        "_peak",
        "_peak_before",
        "_queueing_at",
        "_raised",
        "others",
        "probe",
        "slots",
    )

    def __init__(self) -> None:
        #: the limit, None while unknown
        self.slots: int | None = None
        #: the slots tried past the limit now (see `PROBE_SECONDS`), 0 if none
        self.probe = 0
        self._raised = -math.inf
        #: the most running in this window and in the one before it
        self._bucket, self._peak, self._peak_before = 0, 0, 0
        #: the running count of the last scrape if it found requests waiting
        self._queueing_at: int | None = None
        #: the requests there beyond the router's own in flight (another router's,
        #: another client's) at each of the last two scrapes, and the fewer of the two:
        #: a scrape's counts are up to an engine step older than the router's, so one
        #: alone may count requests that had already ended
        self._others_then = self.others = 0

    def observe(self, running: float, waiting: float, inflight: int) -> None:
        """One scrape's counts, and the router's requests in flight there as it came."""
        others = max(0, int(running + waiting) - inflight)
        self.others, self._others_then = min(others, self._others_then), others
        now, running = time.monotonic(), int(running)
        peak = self._peaked(running, now)
        learned = self.slots
        queueing = waiting > 0 and running > 0
        if queueing and self._queueing_at is not None and running <= self._queueing_at:
            if learned is None:
                self._raised = now  # no probe before one interval at the limit
            self.slots, self.probe = peak, 0
        elif not queueing and learned is not None and running > learned:
            self.slots, self.probe = running, 0
        elif not queueing and running == learned and now - self._raised >= PROBE_SECONDS:
            self.probe, self._raised = max(1, running // 10), now
        self._queueing_at = running if queueing else None

    def _peaked(self, running: int, now: float) -> int:
        """The most running over the last one to two windows, `running` counted."""
        bucket = int(now / WINDOW_SECONDS)
        if bucket != self._bucket:
            self._peak_before = self._peak if bucket == self._bucket + 1 else 0
            self._bucket, self._peak = bucket, 0
        self._peak = max(self._peak, running)
        return max(self._peak, self._peak_before)

    def forget(self) -> None:
        """The backend's metrics went stale: nothing is known of its limit."""
        self.slots = self._queueing_at = None
        self.probe = 0
        self._peak = self._peak_before = self.others = self._others_then = 0
