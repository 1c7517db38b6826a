"""What dispatch passes from step to step: the `Call` an ingress hands in, and the
`Routed` pick an attempt carries out.

Both live apart from dispatcher.py so that every step's module can name them without
importing the Dispatcher that chains the steps.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from multidict import CIMultiDict

from router.config import TokenClass
from router.fleet.backend import Backend
from router.request import Kind
from router.upstream.usage import Usage


class Trace(Protocol):
    """A sampled request's spans, as the steps report to them (router/dispatch/tracing.py)."""

    def routed(self, routed: Routed, strategy: str, began: float, call: Call) -> None: ...

    def attempt_begins(
        self, backend: Backend, method: str, headers: MutableMapping[str, str]
    ) -> None: ...

    def attempt_ends(
        self, status: str, error: Exception | None, first_chunk_at: float | None
    ) -> None: ...

    def finish(
        self, status: str, error: Exception | None, used: Usage, backend: str, retries: int
    ) -> None: ...


@dataclass(slots=True)
class Call:
    """What an ingress hands to dispatch: the parsed routing fields and the raw request."""

    kind: Kind
    req: object
    method: str
    path: str
    body: bytes
    headers: CIMultiDict[str]
    #: when the request arrived: by the event loop's clock (the deadlines'), and by
    #: `time.perf_counter()` (the latencies': the loop's ticks in ms on uvloop)
    started: float
    arrived: float
    tenant: str | None = None
    #: the id its answer, its backend and the access log name it by (X-Request-Id)
    request_id: str = ""
    #: attempts begun so far (the first, then each retry's)
    attempts: int = 0
    #: its spans, when tracing is on and it is sampled
    trace: Trace | None = None
    #: the prompt's exact token ids, when a backend's /tokenize supplied them
    token_ids: list[int] | None = None
    #: the pool roles its picks are made in (None: every pool); "decode" once its
    #: prompt was prefilled on another backend (disaggregated serving)
    role: str | None = None
    #: the backend that prefilled it, with disaggregated serving
    prefilled_by: str | None = None
    #: the body as the client sent it, when the request is captured (router/capture.py)
    capture: bytes | None = None
    #: the headers (gRPC: the metadata, a binary value as bytes) as the client sent
    #: them, which the capture records (None: `headers`, when the ingress made them up)
    sent_headers: Mapping[str, str | bytes] | None = None
    #: the router asked for the stream's usage: its usage event is not the client's
    strip_usage: bool = False
    #: the answer's status line went to the client (a stream began): a failure after it
    #: reaches the client as an error event, under that status
    began: bool = False
    #: why its backend was picked, for the answer's x-kvroute-reason ("": not sent)
    decision: str = ""
    #: its priority class: set by the router for async jobs, else once admission
    #: took it from the tenant or the header (router/dispatch/flow.py)
    priority: str | None = None
    #: its static token's class, which counts when its tenant's config sets none
    token_class: TokenClass | None = None
    #: seconds it waited in admission's queue (0: admitted at once)
    queued: float = 0.0


class Routed(NamedTuple):
    backend: Backend
    #: why the policy picked it (its decision's reason, as the metrics label it)
    reason: str = ""
    #: prompt tokens, and how many of them the policy expects cached (KV-aware policies)
    prompt_tokens: int = 0
    predicted_cached: int = 0
    #: the backend's queued prompt tokens and requests in flight when it was picked
    #: (router/fleet/speeds.py learns its speed from them)
    ahead: int = 0
    running: int = 0
    #: the prompt's block keys, which the answer's cached tokens check (KV-aware policies)
    blocks: Sequence[int] = ()
