"""What dispatch passes from step to step: the `Call` an ingress hands in, and the
`Routed` pick an attempt carries out.

Both live apart from dispatcher.py so that every step's module can name them without
importing the Dispatcher that chains the steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from multidict import CIMultiDict

from router.fleet.backend import Backend
from router.request import Kind


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
    #: the prompt's exact token ids, when a backend's /tokenize supplied them
    token_ids: list[int] | None = None


class Routed(NamedTuple):
    backend: Backend
    #: prompt tokens, and how many of them the policy expects cached (KV-aware policies)
    prompt_tokens: int = 0
    predicted_cached: int = 0
