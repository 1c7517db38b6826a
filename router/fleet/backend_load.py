"""A backend's load: the router-wide in-flight count (summed over the workers through
shared_load.py when there are several; dispatch's accounting keeps it exact), the
queued prompt tokens, plus the other replicas' when they share their load (config
`cluster`, router/telemetry/cluster.py), and the router's requests there whose answer
has not begun (flow control's estimate of the backend's queue between scrapes).
"""

from __future__ import annotations

from router.config import BackendConfig
from router.fleet.shared_load import LoadTable


class BackendLoad:
    """The load part of `Backend` (backend.py): what the policies read per pick."""

    __slots__ = (
        "local_inflight",
        "local_queued",
        "local_unstarted",
        "remote_inflight",
        "remote_queued",
        "slot",
        "table",
    )

    def __init__(self, cfg: BackendConfig, table: LoadTable | None) -> None:
        #: this process's requests in flight here, and their queued prompt tokens
        self.local_inflight = 0
        self.local_queued = 0
        #: this process's requests here whose answer has not begun
        self.local_unstarted = 0
        #: the other router replicas' requests in flight here and their queued prompt
        #: tokens (config `cluster`; 0 alone)
        self.remote_inflight = 0
        self.remote_queued = 0
        #: with several workers: the shared table and this backend's slot in it
        self.slot = None if table is None else table.slot(cfg.key, cfg.url)
        self.table = None if self.slot is None else table

    @property
    def own_inflight(self) -> int:
        """Requests in flight here, router-wide (every worker's, when there are several)."""
        table = self.table
        return self.local_inflight if table is None else table.inflight(self.slot)

    @property
    def inflight(self) -> int:
        """Requests in flight here: this router's and its sharing replicas'."""
        return self.own_inflight + self.remote_inflight

    @property
    def own_queued_tokens(self) -> int:
        """This router's prompt tokens sent here, expected uncached, not yet answered."""
        table = self.table
        return self.local_queued if table is None else table.queued_tokens(self.slot)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens sent here and expected uncached, not yet answered (KV_AWARE):
        this router's and its sharing replicas'."""
        return self.own_queued_tokens + self.remote_queued

    @property
    def unstarted(self) -> int:
        """This router's requests sent here whose answer has not begun (no first token
        of a stream yet, no answer yet otherwise), router-wide."""
        table = self.table
        return self.local_unstarted if table is None else table.unstarted(self.slot)

    def count(self, requests: int, tokens: int, unstarted: int | None = None) -> None:
        """The request path's accounting: attempts begin (+1) and end (-1) here, not
        begun until `unstarted` says otherwise (default: as `requests`)."""
        unstarted = requests if unstarted is None else unstarted
        self.local_inflight += requests
        self.local_queued += tokens
        self.local_unstarted += unstarted
        if self.table is not None:
            self.table.add(self.slot, requests, tokens, unstarted)
