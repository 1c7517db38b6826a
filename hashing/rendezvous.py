"""Weighted rendezvous (highest random weight) hashing: one key, a few candidates, one winner.

For a key k and a member m with weight w, the score is ``w / -ln(u)`` where ``u`` in (0, 1)
is a 64-bit mix of ``k`` and m's name hash. The highest score wins, so:

- every process and replica that hashes the same key over the same candidates picks the
  same member, with no shared state (the scores depend only on the key and the names);
- dropping a candidate that did not win leaves the winner unchanged, and a member's
  chance of winning is its share of the candidates' total weight (Schindelhauer and
  Schomaker's weighted form: ``-w / ln(u)`` is an exponential race);
- a tie in score (a 2**-64 event) goes to the lower name hash, so even that is agreed.

KV_AWARE uses it to place a prefix that no backend holds: the near-tied candidates are
a set every router agrees on far more often than on a random draw from it.

Cost: one splitmix64 finaliser and one ``log`` per candidate (pure integer and float
arithmetic, no allocation); name hashes are computed once by the caller (`name_hash`).
"""

from __future__ import annotations

import math

import xxhash

__all__ = ["name_hash", "score"]

_MASK = (1 << 64) - 1
_SCALE = 1.0 / (1 << 52)


def name_hash(name: str) -> int:
    """A member's 64-bit identity in the race (stable across processes and machines)."""
    return xxhash.xxh3_64_intdigest(name.encode())


def score(key: int, member: int, weight: int = 1) -> tuple[float, int]:
    """The member's rank for `key` (compare with `max`); `member` is its `name_hash`."""
    x = (key ^ member) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    u = ((x >> 12) + 0.5) * _SCALE  # 52 bits and a half: exactly inside (0, 1)
    return weight / -math.log(u), -member
