"""The fleet's reserved room (flow.py, "The reserve"): who may take it, and how many
slots are kept now.

It is kept while requests that may take it (a tenant under its share, shares.py, or a
class above a waiting one) came within the last `RESERVE_SECONDS` beside other flows'
waiters: as many slots as keep one free for 99% of them at their rate against the
fleet's completion rate (flow.py's `reserve_for`), at most `saturation.reserve` of the
fleet's learned slots, or twice that (at most half) while some came for outranking a
waiting class: the lower class is the one to refuse first, and a higher one at a steady
rate needs more kept slots than a quiet tenant. Cost: O(1) per request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from router.dispatch.flow import Rate, reserve_for
from router.dispatch.saturation import Room
from router.dispatch.shares import Shares

#: how long the reserve holds after a request that may take it came beside waiters, s
RESERVE_SECONDS = 1.0


class Reserve:
    """One worker's reserve: its tenants' shares, and the rate of requests it is for."""

    def __init__(self, room: Room, completions: Rate, weight: Callable[[str], float]) -> None:
        """`completions`: the requests leaving, per second; `weight`: a tenant's now."""
        self._room, self._completions = room, completions
        #: each tenant's requests here against its fair share
        self.shares = Shares(weight)
        self._wanted = Rate()
        self._wanted_at = self._outranking_at = -math.inf

    def wanted(self, outranking: bool) -> None:
        """A request that may take the reserve came beside waiters (`outranking`: for
        being of a class above a waiting one)."""
        now = time.monotonic()
        self._wanted_at = now
        if outranking:
            self._outranking_at = now
        self._wanted.count()

    def size(self) -> int:
        """The slots kept now (none unless such a request came lately)."""
        now = time.monotonic()
        if now - self._wanted_at > RESERVE_SECONDS:
            return 0
        most = self._room.reserve()
        if now - self._outranking_at <= RESERVE_SECONDS:
            most = min(2 * most, self._room.slots() // 2)
        return reserve_for(self._wanted.per_second(), self._completions.per_second(), most)

    def under_share(self, tenant: str) -> bool:
        return self.shares.under(tenant, self._room.slots())
