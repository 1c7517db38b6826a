"""What admission's caps are checked against: requests counted per key (the total, or a
tenant's key), this process's own (`LocalCounts`), or with several workers the shared
admission table (shared_admission.py), which also tells each worker the others'
waiters by class and their flow signals (signals.py)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

from router.config import PRIORITIES
from router.dispatch.session import SessionRecords
from router.dispatch.signals import FlowCells


class Counts(Protocol):
    """Requests counted per key (TOTAL, or a tenant's key), each against a cap."""

    shared: bool  # other processes change the counts too
    #: the session affinity records shared with the other processes, if any
    sessions: SessionRecords | None
    #: the flow signals every process publishes (signals.py)
    cells: FlowCells

    def key(self, tenant: str) -> Hashable:
        """What `tenant` is counted under."""

    def take(self, key: Hashable, cap: int) -> bool:
        """Count one more under `key` if that stays within `cap`."""

    def give(self, key: Hashable) -> None: ...

    def count(self, key: Hashable) -> int:
        """The requests counted under `key` now."""

    def set_waiting(self, rank: int, depth: int) -> None:
        """This process's waiters of class `rank` now."""

    def waiting_above(self, rank: int) -> bool:
        """Does another process have a waiter of a class above `rank`?"""

    def waiting_in(self, ranks: range) -> bool:
        """Does any process, this one included, have a waiter of a class in `ranks`?"""


class LocalCounts:
    """One process's counts: the whole router's when it is the only worker."""

    shared = False
    sessions = None

    def __init__(self) -> None:
        self._counts: dict[Hashable, int] = {}
        self.cells = FlowCells.local()
        self._waiting = [0] * len(PRIORITIES)

    def key(self, tenant: str) -> str:
        return tenant

    def take(self, key: Hashable, cap: int) -> bool:
        count = self._counts.get(key, 0)
        if count >= cap:
            return False
        self._counts[key] = count + 1
        return True

    def give(self, key: Hashable) -> None:
        count = self._counts[key] - 1
        if count:
            self._counts[key] = count
        else:
            del self._counts[key]  # bounded: only keys with requests in flight

    def count(self, key: Hashable) -> int:
        return self._counts.get(key, 0)

    def set_waiting(self, rank: int, depth: int) -> None:
        self._waiting[rank] = depth

    def waiting_above(self, rank: int) -> bool:
        return False  # no other process

    def waiting_in(self, ranks: range) -> bool:
        return any(self._waiting[rank] for rank in ranks)
