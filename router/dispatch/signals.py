"""What each worker tells the others about its flow, and reads of theirs: the rates and
moments the reserve is sized by and the weights of the tenants present (reserve.py,
shares.py), so that the reserve and the fair shares hold for the whole router, not one
worker's part of it.

Cells of int64, one column per worker, as the shared admission table keeps its counts
(shared_admission.py, whose rows these are with several workers): a worker writes only
its own column, a reader combines the columns. A router of one process keeps the same
cells in its own memory (`FlowCells.local`), so the code is one.

Rows (`ROWS` of them):
- `WEIGHTS`: the weights of the tenants with requests in this worker, in thousandths;
  the router's is the largest of them (exact while each worker sees every tenant
  present, as connections spread over the workers; a tenant seen by one worker only
  counts there alone, which lets the others' tenants reckon a larger share);
- `WANTED_AT`, `OUTRANKING_AT`: when a request that may take the reserve last came here
  (milliseconds of the system-wide monotonic clock), and one for outranking a waiting
  class;
- `WANTED` and `LEFT`: two `Rate`s, requests wanting the reserve and requests leaving,
  three rows each (the second counted, its count, the count of the second before);
- `PENDING`: the waiters this worker released whose requests do not yet count on a
  backend (waiting.py): every worker subtracts every worker's from the fleet's room, so
  two workers never hand out the same free slot.

A row read while another worker writes it may be one event behind: each cell is one
aligned store, and every use here tolerates that.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence

WEIGHTS, WANTED_AT, OUTRANKING_AT, WANTED, LEFT, PENDING = 0, 1, 2, 3, 6, 9
ROWS = 10
#: thousandths: weights are kept as int64
_MILLI = 1000


class FlowCells:
    """`ROWS` rows of one int64 per worker; `worker` is the column this process writes."""

    __slots__ = ("_words", "worker", "workers")

    def __init__(self, words: memoryview | array, workers: int, worker: int) -> None:
        self._words, self.workers, self.worker = words, workers, worker

    @classmethod
    def local(cls) -> FlowCells:
        """The cells of a router of one process."""
        return cls(array("q", bytes(8 * ROWS)), 1, 0)

    def own(self, row: int) -> int:
        return self._words[row * self.workers + self.worker]

    def set(self, row: int, value: int) -> None:
        self._words[row * self.workers + self.worker] = value

    def row(self, row: int) -> Sequence[int]:
        """Every worker's cell of `row`."""
        start = row * self.workers
        return self._words[start : start + self.workers]

    def add(self, row: int, change: int) -> None:
        self.set(row, self.own(row) + change)

    def total(self, row: int) -> int:
        """`row` summed over the workers."""
        return sum(self.row(row))

    def set_weights(self, weights: float) -> None:
        self.set(WEIGHTS, round(weights * _MILLI))

    def weights(self) -> float:
        """The weights of the tenants present in the router (the largest worker's)."""
        return max(self.row(WEIGHTS)) / _MILLI

    def mark(self, row: int) -> None:
        """Now is when `row`'s event last came here."""
        self.set(row, int(time.monotonic() * _MILLI))

    def since(self, row: int) -> float:
        """Seconds since `row`'s event last came to any worker."""
        return time.monotonic() - max(self.row(row)) / _MILLI


class Rate:
    """Events per second over the last one to two seconds (two one-second buckets),
    counted in this worker's cells (`first` and the two rows after), read for this
    worker (`per_second`) or for the router (`everywhere`)."""

    __slots__ = ("_cells", "_first")

    def __init__(self, cells: FlowCells | None = None, first: int = WANTED) -> None:
        self._cells = cells or FlowCells.local()
        self._first = first

    def count(self) -> None:
        cells, first = self._cells, self._first
        second = int(time.monotonic())
        counted = cells.own(first)
        if second != counted:
            before = cells.own(first + 1) if second == counted + 1 else 0
            cells.set(first + 2, before)
            cells.set(first + 1, 0)
            cells.set(first, second)
        cells.add(first + 1, 1)

    def per_second(self) -> float:
        cells, first = self._cells, self._first
        return _per_second(cells.own(first), cells.own(first + 1), cells.own(first + 2))

    def everywhere(self) -> float:
        """The router's rate: every worker's summed."""
        cells, first = self._cells, self._first
        columns = zip(cells.row(first), cells.row(first + 1), cells.row(first + 2), strict=True)
        return sum(_per_second(*column) for column in columns)


def _per_second(second: int, now: int, before: int) -> float:
    """The rate of a bucket pair last counted in `second`, read now: both buckets while
    that second lasts, the newer one the second after, nothing later."""
    clock = time.monotonic()
    elapsed = int(clock) - second
    if elapsed == 0:
        return (before + now) / (1 + clock % 1)
    if elapsed == 1:
        return now / (1 + clock % 1)
    return 0.0
