"""PREFIX_AWARE: pin each prompt prefix to one backend by consistent hashing, with bounded load.

The fingerprint of the first `prefix_length` tokens (model and tenant mixed in) is
looked up on a hash ring over every configured backend, so all router processes and
replicas with the same backend list agree on a new prefix's owner without sharing
state, and adding or removing one of N backends moves about 1/N of the prefixes.

Sticky until the load is real. A prefix stays on the backend it went to last while that
backend is under the bound: moving it costs a whole uncached prefill there, while one
more sequence in a batch that decodes dozens costs a fraction of a step. With T the
in-flight requests of the candidates and W their total weight, a backend is full when

    inflight(b) >= load_floor  and  inflight(b) >= load_factor * (T + 1) * weight(b) / W

or when inflight(b) >= `concurrency_threshold` (the absolute cap). The "+ 1" is the
request being placed. Under `load_floor` requests a backend is never full for the
relative cap, so a light fleet keeps every prefix where it is.

A full (or unusable) backend hands the prefix on along that fingerprint's ring order
(`HashRing.walk`), starting after the backend it leaves and wrapping round, to the
first backend under the mean (T + 1) * weight / W, and the prefix stays there in turn.
A move past an unusable backend alone (drained, down) is not remembered: the walk
finds the same next backend without it, and the prefix goes back when its backend does.
So a hot prefix moves only when its backend is loaded beyond its share, and one prefix
that is the whole load (every conversation behind one system prompt longer than
`prefix_length`) turns through every backend. Walking from the owner instead would
fill the first backends of its run to the cap and leave the last only what they cannot
take (with load_factor 1.25 on 4 backends, 4 - 3 x 1.25 = a quarter of the mean).
A pick where the prefix went last is `warm`: flow control's saturation keeps it there
rather than move it to a backend with room, where it would be a whole uncached prefill
(the bound above moves it). A new prefix starts at its owner and takes the first backend
that is not full. When
every candidate is at `concurrency_threshold` (the relative caps alone always leave
room), the least loaded wins (ALL_SATURATED, ties at random).

Where each prefix went last (its fingerprint, the backend, an expiry `REMEMBER_S` after
its last use) is this worker's memory alone with one worker (`LastPlaced`), and with
several the router's placements table (`Policy.share`, router/fleet/placements.py),
read and written under its pick lock, so every worker of a router walks alike: what
one moves, the next request through another finds where it went. Router replicas do
not share it: each moves a prefix by the loads it sees, as each sees its own.

Trade-off. A lower load_factor or load_floor moves a prefix sooner: better balance,
more cache misses. When one shared system prompt is longer than `prefix_length`, every
request has the same fingerprint and no conversation keeps a backend of its own: raise
`prefix_length` past the shared part to pin each conversation. load_factor must be
above 1.0: at 1.0 every backend must stay within one request of the mean.

Reads: fingerprint, candidate names, in-flight counts and weights, one lookup of where
the prefix went last. Cost: one pass over the candidates to total their load, O(log V)
for the ring lookup when it walks, then a few ring points per skipped backend; with
several workers, one probe of the placements table per backend (a pick lock already
held), and a write only when the prefix moves or its memory is half way to expiring.
With 64 backends a pick takes about 4 us. The ring is rebuilt only on fleet change.

Parameters (defaults):
  prefix_length (256): leading tokens that form the fingerprint.
  load_factor (1.5, > 1.0, null = no relative cap): how far above the mean in-flight
      load (per unit of weight) a backend may go before its prefixes move on.
  load_floor (4): in-flight requests under which the relative cap never binds.
  concurrency_threshold (32, null = no absolute cap): in-flight requests at which a
      backend is full whatever the mean.
  tokenizer: {kind: approx, chars_per_token: 4.0} or {kind: hf, path: /models/tok/}.
  vnodes (512): ring points per unit of backend weight.
  seed (unset): fixes the tie-break among saturated backends.
YAML:
  routing:
    strategy: PREFIX_AWARE
    prefix_length: 256
    load_factor: 1.5
    load_floor: 4
    concurrency_threshold: 32
    tokenizer: {kind: approx, chars_per_token: 4.0}
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator, Sequence
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from hashing.fingerprint import Fingerprinter
from hashing.ring import DEFAULT_VNODES, HashRing
from hashing.tokens import make_tokenization
from policies.base import (
    BackendLike,
    FleetView,
    Pick,
    Placements,
    Policy,
    PolicyParams,
    Reason,
    RouteRequest,
    load_cap_per_weight,
)
from policies.least_outstanding_requests import least_loaded
from policies.registry import register

#: how long a prefix's last backend is remembered after its last request
REMEMBER_S = 600.0
#: prefixes one worker remembers without shared placements (the oldest go first)
_LOCAL_PREFIXES = 1 << 16


class TokenizerParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How prompt text is counted in tokens for the fingerprint."""

    kind: Literal["approx", "hf"] = "approx"
    chars_per_token: Annotated[float, Meta(gt=0)] = 4.0
    path: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "hf" and not self.path:
            raise ValueError("tokenizer.kind 'hf' needs tokenizer.path (a tokenizer.json)")


class PrefixAwareParams(PolicyParams, tag="PREFIX_AWARE"):
    #: a pool's caps are its own; the fingerprint (prefix_length, tokenizer) and the
    #: ring (vnodes) are every pool's
    pool_tunable = frozenset({"concurrency_threshold", "load_factor", "load_floor"})
    prefix_length: Annotated[int, Meta(ge=1)] = 256
    concurrency_threshold: Annotated[int, Meta(ge=1)] | None = 32
    load_factor: Annotated[float, Meta(gt=1.0)] | None = 1.5
    load_floor: Annotated[int, Meta(ge=1)] = 4
    tokenizer: TokenizerParams = TokenizerParams()
    vnodes: Annotated[int, Meta(ge=1, le=4096)] = DEFAULT_VNODES
    seed: Annotated[int, Meta(ge=0)] | None = None


class LastPlaced:
    """Where each prefix went last, for one worker alone: `Placements` over one key per
    prompt (its fingerprint), bounded to the most recently placed prefixes."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[int, tuple[str, float]] = {}

    def place(self, backend: str, keys: Sequence[int], start: int, expires_at: float) -> None:
        last = self._last
        for key in keys[start:]:
            last.pop(key, None)
            if len(last) >= _LOCAL_PREFIXES:
                del last[next(iter(last))]
            last[key] = (backend, expires_at)

    def held(self, keys: Sequence[int], start: int) -> tuple[str, int, float] | None:
        found = self._last.get(keys[start])
        if found is None or found[1] <= time.monotonic():
            return None
        return found[0], 1, found[1]


class _Caps(msgspec.Struct, frozen=True):
    """When a backend is full for this pick (`_full`)."""

    per_weight: float
    floor: int
    threshold: int | None


@register
class PrefixAwarePolicy(Policy[PrefixAwareParams]):
    use_when = "replicas must agree on placements with no shared state and no KV events"

    def __init__(self, params: PrefixAwareParams) -> None:
        super().__init__(params)
        tok = params.tokenizer
        self._fingerprinter = Fingerprinter(
            make_tokenization(tok.kind, tok.chars_per_token, tok.path), params.prefix_length
        )
        self._rng = random.Random(params.seed)
        self._members: tuple[BackendLike, ...] = ()
        self._positions: dict[str, int] = {}
        self._ring = HashRing([], params.vnodes)
        self._last: Placements = LastPlaced()

    @property
    def fingerprinter(self) -> Fingerprinter:
        return self._fingerprinter

    @property
    def shares_picks(self) -> bool:
        return True

    def on_fleet_change(self, members: tuple[BackendLike, ...]) -> None:
        self._members = members
        self._positions = {m.name: i for i, m in enumerate(members)}
        self._ring = HashRing([(m.name, m.weight) for m in members], self.params.vnodes)

    def share(self, placements: Placements) -> None:
        self._last = placements

    def pick(self, req: RouteRequest, fleet: FleetView) -> Pick:
        if not fleet.candidates:
            return Pick(None, Reason.NO_CANDIDATE)
        p = self.params
        mean = load_cap_per_weight(1.0, fleet.candidates)
        caps = _Caps(mean * (p.load_factor or math.inf), p.load_floor, p.concurrency_threshold)
        key = (req.fingerprint,)
        last = self._last.held(key, 0)
        at = self._positions.get(last[0]) if last is not None else None
        if at is None:
            reason = Reason.AFFINITY
        else:
            backend = self._members[at]
            if backend.name not in fleet.candidate_names:
                reason = Reason.SPILL_UNAVAILABLE
            elif _full(backend, caps):
                reason = Reason.SPILL_THRESHOLD
                # it outgrew its backend: it moves on to one under the mean
                caps = _Caps(mean if p.load_factor else math.inf, 1, p.concurrency_threshold)
            else:
                self._keep(backend.name, key, last)
                return Pick(backend, Reason.AFFINITY, warm=True)
        for index in self._order(req.fingerprint, at):
            backend = self._members[index]
            if backend.name not in fleet.candidate_names:
                if reason is Reason.AFFINITY:
                    reason = Reason.SPILL_UNAVAILABLE
                continue
            if not _full(backend, caps):
                if reason is not Reason.SPILL_UNAVAILABLE:  # not kept off a backend that
                    self._keep(backend.name, key, None)  # returns (undrained, healthy)
                return Pick(backend, reason)
            reason = Reason.SPILL_THRESHOLD
        backend = least_loaded(fleet.candidates, self._rng)
        self._keep(backend.name, key, last)
        return Pick(backend, Reason.ALL_SATURATED)

    def _order(self, fingerprint: int, at: int | None) -> Iterator[int]:
        """The fingerprint's ring order; from the member after `at` if given, wrapping
        round, so that a prefix outgrowing backend after backend turns through all of
        them, instead of leaving the last of its run only what the others cannot take."""
        walk = self._ring.walk(fingerprint)
        if at is None:
            yield from walk
            return
        before = []
        for index in walk:
            if index == at:
                break
            before.append(index)
        yield from walk
        yield from before

    def _keep(self, name: str, key: tuple[int], last: tuple[str, int, float] | None) -> None:
        """Remember that the prefix went to `name`: written when it moves, and when its
        memory is half way to forgetting, not on every request."""
        now = time.monotonic()
        if last is None or last[0] != name or last[2] - now < REMEMBER_S / 2:
            self._last.place(name, key, 0, now + REMEMBER_S)


def _full(backend: BackendLike, caps: _Caps) -> bool:
    """At the absolute cap, or at the relative one once past the floor. An integer count
    reaches ceil(x) exactly when it reaches x, so the relative cap needs no ceil (and an
    infinite one never binds)."""
    load = backend.inflight
    if caps.threshold is not None and load >= caps.threshold:
        return True
    return load >= caps.floor and load >= caps.per_weight * backend.weight
