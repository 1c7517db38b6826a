"""The one small interface every routing strategy implements.

A policy is pure: it reads a `FleetView` snapshot (the candidates for this request and
their in-flight counts, summed over the router's workers) and returns a `Pick` that says
which backend and why. It never does I/O, so it can be tested with plain objects and
reused by the HTTP and gRPC ingresses alike. Optional hooks default to no-ops so a
stateless policy stays a dozen lines."""

from __future__ import annotations

import copy
import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Generic, NamedTuple, Protocol, TypeVar

import msgspec

if typing.TYPE_CHECKING:
    from hashing.chat_tokens import PromptBlocks
    from hashing.fingerprint import Fingerprinter


class BackendLike(Protocol):
    """What a policy may read of a backend (router/fleet/backend.py provides it)."""

    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> int: ...

    @property
    def inflight(self) -> int: ...


class Placements(Protocol):
    """Where this router's other worker processes just sent prompts (router/fleet/placements.py).

    A policy that learns from its own decisions writes each one here, with no await, and
    reads the others' before it decides (the router holds a lock around both), so that a
    burst of one new prefix spread over several workers by the kernel lands where the
    first of them went.
    """

    def place(self, backend: str, keys: Sequence[int], start: int, expires_at: float) -> None:
        """`backend` was just sent the blocks `keys[start:]` (the ones it did not hold)."""

    def held(self, keys: Sequence[int], start: int) -> tuple[str, int, float] | None:
        """(backend, blocks, expires_at): another worker's recent placement of the blocks
        from `keys[start]` on, and how many of them this prompt shares, if any."""

    def replicate(self, backend: str, keys: Sequence[int], start: int, expires_at: float) -> None:
        """As `place`, for the router's other replicas alone: the workers share the policy's
        index, where the placement is already."""

    def withdraw(self, backend: str, keys: Sequence[int], start: int) -> None:
        """The placement of `keys[start:]` on `backend`, just made in this loop turn, was
        not followed: out of the table, and out of the batch for the other workers."""

    def recall(self, backend: str, keys: Sequence[int], start: int) -> None:
        """As `withdraw`, for a placement `replicate` made: out of the batch for the other
        replicas."""


class Turns(Protocol):
    """A turn counter every worker process of the router shares (router/fleet/shared_load.py):
    the picks taken so far by all of them, so that a rotation is the router's, not each
    process's (two processes with a turn each send two requests that reach them together
    to the same backend)."""

    def take(self) -> int:
        """The router's next turn, counted as taken."""


class Reason(StrEnum):
    """Why a backend was picked; exported as the `reason` label of decisions."""

    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    LEAST_OUTSTANDING = "least_outstanding"
    AFFINITY = "affinity"
    SPILL_THRESHOLD = "spill_threshold"
    SPILL_UNAVAILABLE = "spill_unavailable"
    ALL_SATURATED = "all_saturated"
    NO_CANDIDATE = "no_candidate"
    KV_HIT = "kv_hit"
    #: part of the prompt is loaded from an offload tier (CPU memory, storage) instead
    KV_TIER = "kv_tier"
    KV_COLD = "kv_cold"
    #: the backend that served the request's session last (router/dispatch/session.py)
    SESSION = "session"


SPILL_REASONS = frozenset({Reason.SPILL_THRESHOLD, Reason.SPILL_UNAVAILABLE, Reason.ALL_SATURATED})


class RouteRequest(NamedTuple):
    """The routing-relevant facts of one request, already canonicalised.

    `fingerprint` is filled for policies with a `fingerprinter`; `blocks` (the chain of
    block keys of the prompt's full blocks) and `prompt_tokens` for those with a
    `block_keys` describer. `output_tokens`: the tokens its answer is expected to have
    (its `max_tokens`, else what the router saw of the model's answers; 0: unknown).
    `request_id`: the request's `X-Request-Id`, which a policy that keeps its decisions
    shows beside each (what the access log and traces name it by).
    """

    model: str
    fingerprint: int = 0
    blocks: Sequence[int] = ()
    prompt_tokens: int = 0
    output_tokens: int = 0
    request_id: str = ""


class Speed(NamedTuple):
    """How fast a backend is, as the router learned it (router/fleet/speeds.py): its
    prefill rate, and a decode step's duration with `running` requests in the batch,
    `decode_step_s + decode_s_per_request * running`. A policy reads it as a backend's
    `speed` attribute (None: not learned yet, the policy's configured speeds apply)."""

    prefill_tokens_per_s: float
    decode_step_s: float
    decode_s_per_request: float


@dataclass(frozen=True, slots=True)
class FleetView:
    """A snapshot for one request.

    `members` is every configured backend in configuration order (consistent hashing
    is built over it so that health flaps do not reshuffle prefixes); `candidates` is
    the subset that is healthy and serves the requested model; `candidate_names`
    makes membership checks O(1). The router caches one view per model and rebuilds
    it only when membership or health changes. `panic`: too few were usable, so the
    candidates include backends only their circuit breaker kept out (router/fleet/views.py).
    `turns`: with several worker processes, their shared turn counter.
    """

    members: tuple[BackendLike, ...]
    candidates: tuple[BackendLike, ...]
    candidate_names: frozenset[str]
    panic: bool = False
    #: with several worker processes, their shared turn counter (None: this process's)
    turns: Turns | None = None


class Pick(NamedTuple):
    backend: BackendLike | None
    reason: Reason
    #: prompt tokens the policy expects the backend to find cached (KV-aware policies)
    predicted_cached: int = 0
    #: the prompt's prefix went to this backend before, by the policy's memory, which
    #: counts no tokens (PREFIX_AWARE): a cache expected there, of unknown length
    warm: bool = False
    #: what the policy expects the request to cost the fleet there, in seconds (a
    #: policy that weighs costs: KV_AWARE), None for the others
    cost: float | None = None


def load_cap_per_weight(load_factor: float | None, candidates: Sequence[BackendLike]) -> float:
    """Bounded load: load_factor * (T + 1) / W over the candidates, with T their in-flight
    requests and W their weight; a backend of weight w is full at w times this. The + 1 is
    the request being placed, so a lone request always fits (infinite: no bound)."""
    if load_factor is None:
        return math.inf
    inflight = weight = 0
    for backend in candidates:
        inflight += backend.inflight
        weight += backend.weight
    return load_factor * (inflight + 1) / weight


class PolicyParams(
    msgspec.Struct, tag_field="strategy", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """Base of every strategy's parameters; the subclass tag is its YAML name."""

    #: the parameters a pool may set for itself (`pools[].routing`): those that only
    #: weigh its own backends. The rest shape what every pool shares (the request's
    #: description, the prefix index) and stay the fleet's.
    pool_tunable: ClassVar[frozenset[str]] = frozenset()


def tuned_params(params: PolicyParams, overrides: dict[str, Any]) -> PolicyParams:
    """`params` with a pool's `overrides`, validated as the strategy's own. ValueError
    naming the first key a pool may not set, or the value msgspec rejects."""
    tag = params.__struct_config__.tag
    for key in overrides:
        if key not in type(params).pool_tunable:
            tunable = ", ".join(sorted(type(params).pool_tunable)) or "none"
            raise ValueError(
                f"{key!r} is not a parameter a pool may set for {tag} (the pool's own: "
                f"{tunable}; the others are the fleet's, under routing)"
            )
    merged = {**msgspec.to_builtins(params), **overrides, "strategy": tag}
    try:
        return msgspec.convert(merged, type(params))
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None


P = TypeVar("P", bound=PolicyParams)


class Policy(Generic[P]):
    """Base class: subclasses implement `pick`; hooks are optional."""

    params_type: ClassVar[type[PolicyParams]]
    #: `kvroute policies`: when to choose this strategy (a clause after "when")
    use_when: ClassVar[str] = ""

    def __init__(self, params: P) -> None:
        self.params = params

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], PolicyParams):
                cls.params_type = args[0]

    @property
    def fingerprinter(self) -> Fingerprinter | None:
        """The fingerprint this policy needs, or None to skip fingerprinting."""
        return None

    @property
    def block_keys(self) -> PromptBlocks | None:
        """The block-key describer this policy needs (`RouteRequest.blocks`), or None."""
        return None

    @property
    def shares_picks(self) -> bool:
        """It writes its picks to the shared placements (`share`) and reads the other
        workers' before it picks, so a pick holds their lock: the KV-aware ones."""
        return self.block_keys is not None

    def pick(self, req: RouteRequest, fleet: FleetView) -> Pick:
        raise NotImplementedError

    def retract(self, req: RouteRequest, pick: Pick) -> None:
        """The router did not follow `pick`, this policy's latest for `req` on that backend
        (it picked again among other candidates, or for a session): forget what the pick
        learned, or the policy would believe a backend holds a prompt never sent there."""

    def tuned(self, params: P) -> Policy[P]:
        """This policy with a pool's own `params` (from `tuned_params`): a shallow copy,
        so it shares what this one learns (index, placements, recent decisions). It is
        told its members and placements as this one is; what either rebinds there is its
        own (a ring, a name map), what they mutate is shared."""
        twin = copy.copy(self)
        twin.params = params
        return twin

    def on_fleet_change(self, members: tuple[BackendLike, ...]) -> None:
        """Called when backends are added, removed or re-weighted."""

    def share(self, placements: Placements) -> None:
        """Called, with several worker processes, with their shared recent placements."""

    def share_index(self, directory: str) -> None:
        """Called first, with several processes on one host, with the directory (a tmpfs)
        where what they all read can live once: a policy's prefix index."""

    def pace(self, keys: int) -> None:
        """Called by a router that drains (`drain`) between requests: a pick may then leave
        its upkeep past its first `keys` units of work pending (`deferred`)."""

    @property
    def deferred(self) -> bool:
        """Whether upkeep is pending, for `drain`."""
        return False

    def drain(self) -> bool:
        """Do one slice of pending upkeep; True while some remains."""
        return False
