"""PREFIX_AWARE: pin each prompt prefix to one backend by consistent hashing.

The fingerprint of the first `prefix_length` tokens (model and tenant mixed in) is
looked up on a hash ring over every configured backend, so all router processes and
replicas with the same backend list agree without sharing state, and adding or
removing one of N backends moves about 1/N of the prefixes.

Bounded load: when the owner's in-flight count is at or above `concurrency_threshold`,
the walk continues clockwise to the next distinct backend, the same order for that
fingerprint on every replica, so a hot prefix spreads over a small, stable set of
backends instead of scattering. Backends that are not candidates (unhealthy, or not
serving the model) are skipped the same way. If every candidate is at the threshold,
the least loaded one wins (ties at random).

Reads: fingerprint, candidate names, in-flight counts. Cost: O(log V) for the ring
lookup plus one step per skipped backend; the ring is rebuilt only on fleet change.

Parameters (defaults):
  prefix_length (256): leading tokens that form the fingerprint.
  concurrency_threshold (32, null = never spill): in-flight requests at which a pinned
      backend is considered full.
  tokenizer: {kind: approx, chars_per_token: 4.0} or {kind: hf, path: /models/tok/}.
  vnodes (512): ring points per unit of backend weight.
YAML:
  routing:
    strategy: PREFIX_AWARE
    prefix_length: 256
    concurrency_threshold: 32
    tokenizer: {kind: approx, chars_per_token: 4.0}
"""

from __future__ import annotations

import random
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
    Policy,
    PolicyParams,
    Reason,
    RouteRequest,
)
from policies.least_outstanding_requests import least_loaded
from policies.registry import register


class TokenizerParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How prompt text is counted in tokens for the fingerprint."""

    kind: Literal["approx", "hf"] = "approx"
    chars_per_token: Annotated[float, Meta(gt=0)] = 4.0
    path: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "hf" and not self.path:
            raise ValueError("tokenizer.kind 'hf' needs tokenizer.path (a tokenizer.json)")


class PrefixAwareParams(PolicyParams, tag="PREFIX_AWARE"):
    prefix_length: Annotated[int, Meta(ge=1)] = 256
    concurrency_threshold: Annotated[int, Meta(ge=1)] | None = 32
    tokenizer: TokenizerParams = TokenizerParams()
    vnodes: Annotated[int, Meta(ge=1, le=4096)] = DEFAULT_VNODES
    seed: Annotated[int, Meta(ge=0)] | None = None


@register
class PrefixAwarePolicy(Policy[PrefixAwareParams]):
    def __init__(self, params: PrefixAwareParams) -> None:
        super().__init__(params)
        tok = params.tokenizer
        self._fingerprinter = Fingerprinter(
            make_tokenization(tok.kind, tok.chars_per_token, tok.path), params.prefix_length
        )
        self._rng = random.Random(params.seed)
        self._members: tuple[BackendLike, ...] = ()
        self._ring = HashRing([], params.vnodes)

    @property
    def fingerprinter(self) -> Fingerprinter:
        return self._fingerprinter

    def on_fleet_change(self, members: tuple[BackendLike, ...]) -> None:
        self._members = members
        self._ring = HashRing([(m.name, m.weight) for m in members], self.params.vnodes)

    def pick(self, req: RouteRequest, fleet: FleetView) -> Pick:
        if not fleet.candidates:
            return Pick(None, Reason.NO_CANDIDATE)
        threshold = self.params.concurrency_threshold
        reason = Reason.AFFINITY
        for index in self._ring.walk(req.fingerprint):
            backend = self._members[index]
            if backend.name not in fleet.candidate_names:
                if reason is Reason.AFFINITY:
                    reason = Reason.SPILL_UNAVAILABLE
                continue
            if threshold is None or backend.inflight < threshold:
                return Pick(backend, reason)
            reason = Reason.SPILL_THRESHOLD
        return Pick(least_loaded(fleet.candidates, self._rng), Reason.ALL_SATURATED)
