"""What router replicas say to each other through Redis (router/telemetry/cluster.py):
the three messages, bounded Structs in msgpack, and the cadence every replica keeps.

A message from Redis is untrusted: `decode` rejects one too large or out of bounds.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

#: how often a replica publishes its load
LOAD_INTERVAL_S = 0.1
#: a replica not heard from for this long is dropped from the load view
PEER_TTL_S = 1.5
#: how often a replica publishes its learned speeds, and how long the others' stand
SPEEDS_INTERVAL_S = 1.0
SPEEDS_TTL_S = 3 * SPEEDS_INTERVAL_S
#: recent placement batches kept in Redis for joining replicas (and heard, for workers)
HISTORY = 2000
#: a message larger than this is malformed (a batch of one turn is far smaller)
MAX_MESSAGE = 4 << 20

_Count = Annotated[int, Meta(ge=0, le=1 << 40)]
_Key = Annotated[int, Meta(ge=0)]  # msgpack holds no integer past 64 bits
_Name = Annotated[str, Meta(max_length=256)]
_Rate = Annotated[float, Meta(gt=0, le=1e12)]
_Seconds = Annotated[float, Meta(ge=0, le=3600)]


class Placed(msgspec.Struct, tag="placed", forbid_unknown_fields=True):
    """One replica's placements of one turn: (backend, expiry in epoch seconds, keys)."""

    router: _Name
    block: Annotated[int, Meta(ge=1)]
    placed: list[tuple[_Name, float, list[_Key]]]


class Load(msgspec.Struct, tag="load", forbid_unknown_fields=True):
    """One replica's load: per backend, requests in flight and queued prompt tokens."""

    router: _Name
    backends: dict[_Name, tuple[_Count, _Count]]


class Speeds(msgspec.Struct, tag="speeds", forbid_unknown_fields=True):
    """One replica's learned speeds: per backend, `Speed`'s figures and the samples
    they come from."""

    router: _Name
    backends: dict[_Name, tuple[_Rate, _Seconds, _Seconds, _Count]]


encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Placed | Load | Speeds).decode


def decode(data: bytes) -> Placed | Load | Speeds:
    """One message; msgspec's DecodeError or ValidationError, or TypeError, if it is
    malformed."""
    if len(data) > MAX_MESSAGE:
        raise msgspec.ValidationError("too large")
    return _decode(data)
