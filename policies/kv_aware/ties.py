"""KV_AWARE's tie-break: which of the near-cheapest candidates a pick goes to.

The minimum wins. Candidates within `tie_seconds` of it, or `tie_fraction` of its cost but
its own decode, tie; among them the one holding the longest prefix wins (a hit saves the
fleet a prefill), and equal holders go to the rendezvous-hash winner of the prompt's first
block that none of them holds (hashing/rendezvous.py).

A prompt cached nowhere goes where it costs least, tied only within `tie_seconds` (every
gap between cold candidates is load, so a wider tie would send it behind another prefill);
among the ties, to those whose first token comes soonest (within `tie_seconds`: equal
costs can hide a wait for another prompt's prefill against a stream more, and the user
waits on the first token), and of them to the emptiest cache (the most `room` where
answers proved a cache's bound, else the fewest blocks held: hashing/prefix_lookup.py
`vacancy`), and exact ties to the rendezvous winner of its first block. On an idle fleet
every cold prompt ties: by rendezvous alone, new documents fall on the backends unevenly
(three of six on one of three), and an engine that keeps two prompts then evicts one
document for another at each turn; the emptiest cache spreads them before any cache's size
is known. Every worker sees the same load table and placements, so the workers of one
router place a new prefix alike; replicas place it alike while their estimates tie and
their indexes agree (an idle or evenly loaded fleet, with `cluster` or KV events) and
otherwise each by its own view. A prompt with no block beyond what the ties hold draws
among them at random (the policy's seeded generator).

Cost: one vacancy and one rendezvous rank per tied candidate, O(1) each; the backends'
identities are memoised.
"""

from __future__ import annotations

import operator
import random

from hashing.prefix_lookup import PrefixLookup
from hashing.rendezvous import name_hash, score
from policies.base import RouteRequest
from policies.kv_aware.cost import Scored
from policies.kv_aware.params import KvAwareParams

__all__ = ["TieBreak"]

_first = operator.itemgetter(0)


class TieBreak:
    def __init__(self, params: KvAwareParams, index: PrefixLookup, rng: random.Random) -> None:
        self.params = params
        self._gpu = index
        self._rng = rng
        #: each backend's rendezvous identity, by name (memoised: names are few)
        self._hashes: dict[str, int] = {}

    def winner(self, req: RouteRequest, scored: list[Scored]) -> Scored:
        """The estimate the pick goes to, of the non-empty `scored`."""
        return self._agreed(req, self._ties(scored))

    def keep(self, names: set[str]) -> None:
        """Forget the identities of backends not in `names` (they left the fleet)."""
        self._hashes = {name: h for name, h in self._hashes.items() if name in names}

    def _ties(self, scored: list[Scored]) -> list[Scored]:
        """The candidates tied for the lowest cost (within `tie_seconds`, or warm within
        `tie_fraction` of the best one's cost but its own decode: the decode every
        candidate adds is no reason to tie wider), narrowed to those of them holding the
        longest prefix."""
        p = self.params
        best = min(scored, key=_first)
        warm = any(s[1] for s in scored)
        limit = best[0] + (max(p.tie_seconds, best[6] * p.tie_fraction) if warm else p.tie_seconds)
        ties = [s for s in scored if s[0] <= limit]
        most = max(s[1] for s in ties)
        return [s for s in ties if s[1] == most]

    def _agreed(self, req: RouteRequest, ties: list[Scored]) -> Scored:
        """The rendezvous winner of the first block the ties do not hold (for a prompt
        cached nowhere, of the emptiest caches of those answering soonest): the same on
        every worker and replica; a prompt without such a block draws at random."""
        if len(ties) > 1 and not ties[0][1]:
            soonest = min(s[5] for s in ties) + self.params.tie_seconds
            ties = self._emptiest([s for s in ties if s[5] <= soonest])
        if len(ties) == 1:
            return ties[0]
        first_new = ties[0][1] // self.params.block_size
        if first_new >= len(req.blocks):
            return ties[self._rng.randrange(len(ties))]
        key = req.blocks[first_new]
        return max(ties, key=lambda s: score(key, self._hash(s[2].name), s[2].weight))

    def _emptiest(self, ties: list[Scored]) -> list[Scored]:
        """The ties whose caches are the emptiest (`vacancy`), all of them if equal."""
        vacancies = [self._gpu.vacancy(s[2].name) for s in ties]
        most = max(vacancies)
        return [s for s, v in zip(ties, vacancies, strict=True) if v == most]

    def _hash(self, name: str) -> int:
        found = self._hashes.get(name)
        if found is None:
            found = self._hashes[name] = name_hash(name)
        return found
