"""The run directory's tables a worker of several shares with the others.

In-flight counts per backend (router/fleet/shared_load.py), placements
(router/fleet/placements.py) and admission counts (router/dispatch/shared_admission.py),
each a file the supervisor created (router/control/supervisor.py). A worker alone has
none: its counts stay in-process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.context import WorkerContext
from router.dispatch.shared_admission import AdmissionTable
from router.fleet.placements import PlacementTable
from router.fleet.shared_load import LoadTable


@dataclass(frozen=True, slots=True)
class SharedTables:
    """This worker's view of the shared tables (all None when it is alone)."""

    load: LoadTable | None = None
    placements: PlacementTable | None = None
    admission: AdmissionTable | None = None

    @classmethod
    def open(cls, context: WorkerContext | None, share: Callable[[bytes], None]) -> SharedTables:
        """The tables of `context`'s run directory; `share` sends this worker's
        placements to the others."""
        if (ctx := context) is None:
            return cls()
        return cls(
            LoadTable(ctx.table_path, ctx.slots, ctx.workers, ctx.index),
            PlacementTable(ctx.placements_path, ctx.index, share),
            AdmissionTable(ctx.admission_path, ctx.workers, ctx.index),
        )

    def close(self) -> None:
        for table in (self.load, self.placements, self.admission):
            if table is not None:
                table.close()
