"""Session affinity: a request naming a session goes where the session went last.

The session is named by the first of `flow.session_affinity.headers` the request sends
(`X-Session-ID`, and the headers coding agents send with each turn). Its backend is the
one that served it last. A new session goes where the policy picks when the policy
weighs each backend's cost (KV_AWARE, `new_sessions: cost`): a conversation's turns
follow its first, so its first decides where all of them decode, and a slower or busier
backend should take fewer. Otherwise it goes to the candidate with the highest
rendezvous hash of (session, backend name) among those not loaded past `load_factor` x
their weight's share of the requests in flight (nor past a floor of 4): every worker
and every replica computes the same one without sharing anything while the fleet is
evenly loaded, and a backend leaving moves only its own sessions. Sessions last, so the
hash alone leaves a backend ~1.5x the mean sessions on 80 over 4; the bound passes over
the one the hash gave too many until the others catch up.

- **soft** (default): the session's backend while it is not saturated (flow.py's
  test on its scraped state); with KV_AWARE it is a strong preference, not an override:
  when the policy expects more of the prompt cached on another backend (`kv_hit`) than
  on the session's, or, where its cost places new sessions (`new_sessions: cost`), the
  request to cost the fleet under `MOVE_SHARE` of what it costs there (a backend found
  slow or overloaded since the session began: the cost counts the prefill of what the
  other backend lacks), that pick stands. By the hash a session stays put otherwise,
  so replicas that share nothing keep finding it where the hash put it. A saturated
  session backend spills to the policy's pick, which becomes the session's backend.
  Asking the policy about the session's backend alone teaches KV_AWARE's index where
  the prompt goes; its first pick, when overruled, stays in the index as a guess until
  that guess expires.
- **hard**: always the session's backend while it is a usable candidate.

Records: with several workers, in the shared admission table (shared_admission.py:
direct-mapped, so every worker sees each spill); with one, an LRU of `max_sessions`.
A session idle `idle_ttl` is forgotten. With no record the rendezvous hash agrees
across workers and replicas, so replicas differ only after a spill, or where their loads
differ across the bound; a policy's pick agrees where replicas share placements (KV
events, `cluster`: the next turn's prompt is found cached where the first went).
Retries are routed as usual (away from the failed backend).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import xxhash
from multidict import CIMultiDict

from policies import Pick, Reason, load_cap_per_weight
from router.config import FlowConfig
from router.dispatch.saturation import saturated
from router.fleet.backend import Backend

#: below this many requests in flight a backend takes new sessions whatever the mean
LOAD_FLOOR = 4
#: a session moves where the policy expects its request to cost under this share of
#: what it costs on the session's backend: well past the estimates' own noise and
#: load's ups and downs (a few streams more on a backend of the same speed cost a few
#: percent), so only a slower or overloaded backend loses its sessions
MOVE_SHARE = 0.8


def rendezvous(session: str, candidates: Sequence[Backend]) -> Backend | None:
    """The candidate with the highest hash of (session, its name)."""
    return max(
        candidates,
        key=lambda b: xxhash.xxh3_64_intdigest(f"{session}\0{b.name}".encode()),
        default=None,
    )


class SessionRecords(Protocol):
    """Where each session went last: keyed by the session's hash, the backend's name
    hash (32 bits) and when (monotonic seconds)."""

    def recall(self, key: int) -> tuple[int, float] | None: ...

    def record(self, key: int, backend: int, at: float) -> None: ...


class LocalRecords:
    """One process's records: an LRU of at most `limit` sessions."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._records: OrderedDict[int, tuple[int, float]] = OrderedDict()

    def recall(self, key: int) -> tuple[int, float] | None:
        return self._records.get(key)

    def record(self, key: int, backend: int, at: float) -> None:
        records = self._records
        records[key] = (backend, at)
        records.move_to_end(key)
        while len(records) > self.limit:
            records.popitem(last=False)  # the least recently used


def _moves(pick: Pick, there: Pick, by_cost: bool) -> bool:
    """Soft affinity: the policy's `pick` wins over the session's backend (`there`, the
    policy's pick among it alone) with a bigger cache found elsewhere, or `by_cost` with
    a cost well under staying's."""
    if pick.reason is Reason.KV_HIT and pick.predicted_cached > there.predicted_cached:
        return True
    if not by_cost or pick.cost is None or there.cost is None:
        return False
    return pick.cost < MOVE_SHARE * there.cost


def name_hash(name: str) -> int:
    """A backend's name as records hold it (32 bits)."""
    return xxhash.xxh3_64_intdigest(name.encode()) >> 32


class Sessions:
    """The session records and the steering of a pick towards them."""

    def __init__(self, flow: FlowConfig, shared: SessionRecords | None = None) -> None:
        limit = flow.session_affinity.max_sessions
        self._records: SessionRecords = shared or LocalRecords(limit)
        self.configure(flow)

    def configure(self, flow: FlowConfig) -> None:
        self._flow, self._cfg = flow, flow.session_affinity
        if isinstance(self._records, LocalRecords):
            self._records.limit = self._cfg.max_sessions

    def session_of(self, headers: CIMultiDict[str]) -> str | None:
        """The session a request names, if affinity is on and it names one."""
        if not self._cfg.enabled:
            return None
        for name in self._cfg.headers:
            value = headers.get(name)
            if value:
                return value[:256]
        return None

    def steer(
        self,
        session: str,
        pick: Pick,
        candidates: Sequence[Backend],
        alone: Callable[[Backend], Pick],
        costed: bool = False,
    ) -> Pick:
        """The pick for a request of `session`: the policy's `pick`, or the session's
        backend; the one chosen is remembered as the session's. `alone(backend)`: the
        policy's pick among that backend alone (what it expects cached there, and what
        it learns from its own picks follows the prompt there). `costed`: the policy
        weighs each backend's cost, so its pick places a new session."""
        by_cost = costed and self._cfg.new_sessions == "cost"
        preferred = self._backend_of(session, candidates, by_cost)
        chosen, hard = pick, self._cfg.mode == "hard"
        if (
            preferred is not None
            and preferred is not pick.backend
            and (hard or not saturated(preferred, self._flow.saturation))
        ):
            there = alone(preferred)
            if hard or not _moves(pick, there, by_cost):
                chosen = Pick(preferred, Reason.SESSION, there.predicted_cached)
        if chosen.backend is not None:
            key = xxhash.xxh3_64_intdigest(session.encode())
            self._records.record(key, name_hash(chosen.backend.name), time.monotonic())
        return chosen

    def _backend_of(
        self, session: str, candidates: Sequence[Backend], by_cost: bool
    ) -> Backend | None:
        """The session's backend: where it went last, else a new one (None: the
        policy's pick places it, `by_cost`)."""
        record = self._records.recall(xxhash.xxh3_64_intdigest(session.encode()))
        if record is not None and time.monotonic() - record[1] < self._cfg.idle_ttl:
            for backend in candidates:
                if name_hash(backend.name) == record[0]:
                    return backend
        if by_cost:
            return None
        return self._new_home(session, candidates)

    def _new_home(self, session: str, candidates: Sequence[Backend]) -> Backend | None:
        """A new session's backend: the rendezvous winner among the candidates under
        the bounded load PREFIX_AWARE uses (`load_cap_per_weight`, weights counted; one
        always is: the least loaded is under any factor over 1)."""
        if not candidates:
            return None
        per_weight = load_cap_per_weight(self._cfg.load_factor, candidates)
        under = [
            b for b in candidates if b.inflight < LOAD_FLOOR or b.inflight < per_weight * b.weight
        ]
        return rendezvous(session, under)
