"""The run directory's tables a worker of several shares with the others.

In-flight counts per backend (router/fleet/shared_load.py), placements
(router/fleet/placements.py) and admission counts (router/dispatch/shared_admission.py),
each a file the supervisor created (router/control/supervisor.py), and the policy's
prefix index (`share_index`: one copy for the host, which every worker and the collector
map). A worker alone has none: its counts and its index stay in-process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import policies
from router import log
from router.context import RUN_PARENT_ENV, WorkerContext
from router.dispatch.shared_admission import AdmissionTable
from router.fleet.placements import PlacementTable
from router.fleet.shared_load import LoadTable

#: the free room the run directory needs for the processes to share one prefix index (a
#: container's /dev/shm is 64 MiB unless it is given more); with less, each keeps a copy
SHARED_INDEX_ROOM = 512 << 20


def index_room(rundir: str) -> bool:
    """The run directory has the room for one prefix index every process maps (the
    supervisor asks, once for all of them); if not, say so."""
    fs = os.statvfs(rundir)
    room = fs.f_bavail * fs.f_frsize
    if room < SHARED_INDEX_ROOM:
        log.server.warning(
            "the run directory %s has %d MiB free, under the %d MiB a shared prefix index "
            "wants: each process keeps its own copy (give /dev/shm more room, e.g. docker "
            "run --shm-size, or point %s elsewhere)",
            rundir,
            room >> 20,
            SHARED_INDEX_ROOM >> 20,
            RUN_PARENT_ENV,
        )
    return room >= SHARED_INDEX_ROOM


def share_index(policy: policies.Policy, context: WorkerContext | None) -> None:
    """Have `policy` keep its prefix index in `context`'s run directory, once for the
    host, where the supervisor found the room for it."""
    if context is not None and context.shared_index:
        policy.share_index(context.rundir)


@dataclass(frozen=True, slots=True)
class SharedTables:
    """This worker's view of the shared tables (all None when it is alone)."""

    load: LoadTable | None = None
    placements: PlacementTable | None = None
    admission: AdmissionTable | None = None

    @classmethod
    def open(
        cls, context: WorkerContext | None, share: Callable[[bytes], None], replicas: bool
    ) -> SharedTables:
        """The tables of `context`'s run directory; `share` sends this worker's
        placements to the others (and, with `replicas`, to the router's other replicas)."""
        if (ctx := context) is None:
            return cls()
        return cls(
            LoadTable(ctx.table_path, ctx.slots, ctx.workers, ctx.index),
            PlacementTable(ctx.placements_path, ctx.index, share, replicas),
            AdmissionTable(ctx.admission_path, ctx.workers, ctx.index),
        )

    def close(self) -> None:
        for table in (self.load, self.placements, self.admission):
            if table is not None:
                table.close()
