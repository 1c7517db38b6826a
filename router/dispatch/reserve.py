"""The fleet's reserved room (flow.py, "The reserve"): who may take it, and how many
slots are kept now.

It is kept while requests that may take it (a tenant under its share, shares.py, or a
class above a waiting one) came within the last `RESERVE_SECONDS` beside other flows'
waiters: as many slots as keep one free for 99.8% of them at their rate against the
fleet's completion rate (flow.py's `reserve_for`), at most `saturation.reserve` of the
fleet's learned slots, or twice that while some came for outranking a
waiting class: the lower class is the one to refuse first, and a higher one at a steady
rate needs more kept slots than a quiet tenant (its requests in flight swing by several
slots while a lower class's request holds the one it took). Each kept slot idles while
the lower class waits, so `saturation.reserve` trades the higher class's tail against
the lower one's throughput. Router-wide: the rates and moments are
every worker's (signals.py). Cost: O(1) per request, O(workers) per size.
"""

from __future__ import annotations

from collections.abc import Callable

from router.dispatch.counts import Counts
from router.dispatch.flow import reserve_for
from router.dispatch.saturation import Room
from router.dispatch.shares import Shares
from router.dispatch.signals import OUTRANKING_AT, WANTED, WANTED_AT, Rate

#: how long the reserve holds after a request that may take it came beside waiters, s
RESERVE_SECONDS = 1.0


class Reserve:
    """The router's reserve, as this worker sees and feeds it: its tenants' shares, and
    the rate of requests it is for."""

    def __init__(
        self, room: Room, counts: Counts, completions: Rate, weight: Callable[[str], float]
    ) -> None:
        """`counts`: admission's, with the flow signals; `completions`: the requests
        leaving, per second; `weight`: a tenant's now."""
        self._room, self._completions = room, completions
        self._cells = counts.cells
        #: each tenant's requests against its fair share
        self.shares = Shares(weight, counts)
        self._wanted = Rate(self._cells, WANTED)

    def wanted(self, outranking: bool) -> None:
        """A request that may take the reserve came beside waiters (`outranking`: for
        being of a class above a waiting one)."""
        self._cells.mark(WANTED_AT)
        if outranking:
            self._cells.mark(OUTRANKING_AT)
        self._wanted.count()

    def size(self) -> int:
        """The slots kept now (none unless such a request came lately)."""
        cells = self._cells
        if cells.since(WANTED_AT) > RESERVE_SECONDS:
            return 0
        most = self._room.reserve()
        if cells.since(OUTRANKING_AT) <= RESERVE_SECONDS:
            most = min(2 * most, self._room.slots())
        wanted, left = self._wanted.everywhere(), self._completions.everywhere()
        return reserve_for(wanted, left, most)

    def under_share(self, tenant: str) -> bool:
        return self.shares.under(tenant, self._room.slots())
