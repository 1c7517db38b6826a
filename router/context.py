"""A process's place in a multi-process router (`kvroute serve --workers N`).

The supervisor (router/control/supervisor.py) gives each child one: which worker it is
(or the collector), and where the run directory's shared tables and sockets are. Plain
data, imported by every stage that shares state between the processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: the collector's index (the workers are 0..N-1)
COLLECTOR = -1
#: a directory to keep run directories in instead of /dev/shm
RUN_PARENT_ENV = "KVROUTE_RUN_PARENT"


@dataclass(frozen=True)
class WorkerContext:
    """What a child needs to know about its place in the router (pickled to it)."""

    index: int  # the worker's column in the load table; COLLECTOR for the collector
    workers: int
    rundir: str
    slots: int
    config_path: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    #: the processes keep one prefix index in the run directory (the supervisor found the
    #: room for it there), so the workers leave the KV events to the collector
    shared_index: bool = False

    @property
    def collector(self) -> bool:
        return self.index == COLLECTOR

    @property
    def feed(self) -> str:
        """The collector's telemetry PUB socket."""
        return f"ipc://{self.rundir}/telemetry.sock"

    @property
    def control(self) -> str:
        """The collector's PULL socket: what a worker sends there reaches every worker."""
        return f"ipc://{self.rundir}/control.sock"

    @property
    def metrics_socket(self) -> str:
        """The collector's Unix socket for the workers' /metrics (control/metrics_relay.py)."""
        return f"{self.rundir}/metrics.sock"

    @property
    def table_path(self) -> str:
        return f"{self.rundir}/load"

    @property
    def placements_path(self) -> str:
        return f"{self.rundir}/placements"

    @property
    def admission_path(self) -> str:
        return f"{self.rundir}/admission"

    @property
    def name(self) -> str:
        return "collector" if self.collector else f"worker {self.index}"
