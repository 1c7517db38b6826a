"""Which backend holds which prefix blocks on which cache medium: the GPU, and offload tiers.

vLLM's KV events name the medium of every store and removal: "GPU" for the block pool,
"CPU" or "STORAGE" (some connectors write them lowercase) from offloading connectors. The
GPU index (`gpu`, which also holds the router's speculative keys) is what a hit means.
Each configured other medium has an index of its own, so a block evicted from the GPU but
still in CPU memory stays reachable, at that tier's cost, and a removal applies to its own
medium only. Media that are not configured are not indexed: their events are counted in
`ignored` (by medium), so an operator can see a tier the router does not score.

A tier marked shared (a store every backend reads, such as LMCache with a remote backend)
is indexed per publisher like the others, but read as a union: a block that any backend
stored there is reachable from every backend.

Offloading connectors publish token-less "placeholder" stores (no token ids, block size 0).
Their keys come from the publisher's other media through the engine hash (`key_of`). vLLM
stores a block to CPU while the GPU still holds it, and a tier keeps its own engine-hash map
for as long as it holds the block. A tier's store that carries tokens chains from its parent
on that medium, or on the GPU.

A tier alone need not hold a prefix: a victim cache holds the tail blocks the GPU evicted
first. The union of a backend's GPU and its tiers up to each one is taken to be
prefix-closed instead, as the GPU's holdings are (hashing/prefix_index.py), so what a
backend reaches per tier is one binary search each (`tier_blocks`). Not thread-safe: one
event loop owns it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hashing.cache_trust import CacheTrust
from hashing.prefix_index import PrefixIndex

__all__ = ["GPU", "Tier", "TieredIndex"]

GPU = "gpu"
#: distinct unknown media counted by name; more are counted as one
_MAX_IGNORED_NAMES = 16
_OTHER = "(other)"


@dataclass(frozen=True, slots=True)
class Tier:
    """A cache medium other than the GPU: what loading one of its tokens costs, and
    whether every backend reads it (a remote store) or only the one that stored it."""

    medium: str
    load_s_per_token: float
    shared: bool = False


#: the tiers holding anything, with their indexes, cheapest first
Reach = tuple[tuple[Tier, PrefixIndex], ...]


class TieredIndex:
    def __init__(self, capacity: int = 1_000_000, tiers: Sequence[Tier] = ()) -> None:
        self.gpu = PrefixIndex(capacity)
        #: what each backend's answers proved its GPU holds (hashing/cache_trust.py)
        self.trust = CacheTrust(self.gpu)
        #: cheapest first: the order a prompt's blocks are best loaded in
        self.tiers = tuple(sorted(tiers, key=lambda t: t.load_s_per_token))
        self._media = {GPU: self.gpu} | {t.medium: PrefixIndex(capacity) for t in self.tiers}
        self._indexed = tuple((t, self._media[t.medium]) for t in self.tiers)
        #: events skipped because their medium is not configured, by medium
        self.ignored: dict[str, int] = {}
        #: per backend, when (its clock) the last event batch applied here was published
        self.published: dict[str, float] = {}
        #: the tables are files every process of the host maps (`share`)
        self._shared = False

    def index_of(self, medium: Any) -> PrefixIndex | None:
        """The index of an event's medium (none named: the GPU); None, counted, if the
        medium is not configured."""
        name = GPU if medium is None else str(medium).lower()
        found = self._media.get(name)
        if found is None:
            if name not in self.ignored and len(self.ignored) >= _MAX_IGNORED_NAMES:
                name = _OTHER
            self.ignored[name] = self.ignored.get(name, 0) + 1
        return found

    def stored(
        self,
        backend: str,
        medium: Any,
        parent_engine: int | None,
        engine_hashes: Sequence[int],
        token_ids: Sequence[int],
        block_size: int,
        root: int,
    ) -> bool:
        """A BlockStored with tokens; False when nothing was stored (unknown medium or
        parent)."""
        index = self.index_of(medium)
        if index is None:
            return False
        also = None if index is self.gpu else self.gpu
        hashes, tokens = engine_hashes, token_ids
        return index.stored(backend, parent_engine, hashes, tokens, block_size, root, also)

    def placed(self, backend: str, medium: Any, engine_hashes: Sequence[int]) -> int:
        """A token-less BlockStored on an offload tier: the blocks whose keys the publisher's
        other media know are stored; returns how many."""
        index = self.index_of(medium)
        if index is None or index is self.gpu:
            return 0
        pairs = [(key, e) for e in engine_hashes if (key := self._key_of(backend, e)) is not None]
        index.placed(backend, pairs)
        return len(pairs)

    def removed(self, backend: str, medium: Any, engine_hashes: Sequence[int]) -> None:
        index = self.index_of(medium)
        if index is not None:
            index.removed(backend, engine_hashes)

    def cleared(self, backend: str) -> None:
        """AllBlocksCleared, a restart or an event gap: none of the backend's holdings on
        any medium can be trusted any more."""
        for index in self._media.values():
            index.cleared(backend)

    def steady(self) -> contextlib.AbstractContextManager[None]:
        """No other process changes the tables until the block ends, so that one
        decision's reads agree with each other (shared tables; nothing to hold for a
        process's own). The media are held in one order in every process."""
        return self._held() if self._shared else contextlib.nullcontext()

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        indexes = list(self._media.values())
        held = 0
        try:
            for index in indexes:
                index.hold()
                held += 1
            yield
        finally:
            for index in reversed(indexes[:held]):
                index.let_go()

    def join(self, backends: Iterable[str]) -> None:
        """Give each of the fleet's `backends` its place in every medium's table."""
        backends = list(backends)
        for index in self._media.values():
            index.join(backends)

    def forget(self, backend: str) -> None:
        for index in self._media.values():
            index.forget(backend)
        self.trust.forget(backend)
        self.published.pop(backend, None)

    def reach(self) -> Reach:
        """The tiers that hold anything, cheapest first (empty, and cheap, when none does):
        what a request's scoring looks at beyond the GPU."""
        return tuple([pair for pair in self._indexed if pair[1].holder_keys()])

    def tier_blocks(
        self, keys: Sequence[int], backend: str, gpu_blocks: int, reach: Reach
    ) -> tuple[int, ...]:
        """For each tier of `reach`, how many leading blocks of `keys` `backend` reaches on
        its GPU, that tier or a cheaper one (non-decreasing; `gpu_blocks` is the GPU's).

        Each tier alone need not hold a prefix: a victim cache holds the tail blocks the GPU
        evicted first. The union of the GPU and the tiers up to each is taken to be
        prefix-closed instead, so each figure is one binary search over that union."""
        gpu = self.gpu.held(backend)
        maps = [] if gpu is None else [gpu]
        found, lo = [], gpu_blocks
        for tier, index in reach:
            held = index.anywhere() if tier.shared else index.held(backend)
            if held is not None:
                maps.append(held)
            lo = _run(keys, maps, lo, len(keys))
            found.append(lo)
        return tuple(found)

    def tier_holders(self, keys: Sequence[int], limit: int, reach: Reach) -> set[str]:
        """Backends holding the longest prefixes of `keys` on the local tiers of `reach`
        (a shared tier's holders are every backend)."""
        return {
            name
            for tier, index in reach
            if not tier.shared
            for name, _ in index.holders(keys, limit)
        }

    def share(self, directory: str) -> None:
        """Keep each medium's table in a file of `directory` that every process of the
        host maps (`index-<medium>`), before anything is in them."""
        for medium, index in self._media.items():
            index.share(f"{directory}/index-{medium}")
        self._shared = True

    @property
    def shared(self) -> bool:
        """The tables are the host's, one for every process (`share`)."""
        return self._shared

    def nbytes(self, shared: bool) -> dict[str, int]:
        """The bytes each medium's table takes; without `shared`, 0 for a table in a
        shared file (so a sum over processes counts it once)."""
        return {
            medium: index.nbytes if shared or not index.shared else 0
            for medium, index in self._media.items()
        }

    def cut_short(self) -> int:
        """Writes the media's shared files had no room to finish, all told."""
        return sum(index.cut_short for index in self._media.values())

    def tier_sizes(self, backend: str) -> dict[str, int]:
        """The keys `backend` holds on each offload tier."""
        return {t.medium: index.size(backend)[0] for t, index in self._indexed}

    def snapshot(self, backend: str) -> dict[str, list[tuple[int, int]]]:
        """`backend`'s confirmed keys on every medium (PrefixIndex.snapshot)."""
        return {medium: index.snapshot(backend) for medium, index in self._media.items()}

    def restore(self, backend: str, media: dict[str, Sequence[Sequence[int]]]) -> None:
        """Replace `backend`'s keys on every medium with a `snapshot`'s."""
        for medium, index in self._media.items():
            index.restore(backend, media.get(medium, ()))

    def _key_of(self, backend: str, engine: int) -> int | None:
        for index in self._media.values():
            key = index.key_of(backend, engine)
            if key is not None:
                return key
        return None


def _run(keys: Sequence[int], maps: Sequence[Container[int]], lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with keys[n - 1] in one of `maps` (keys[:lo] are), by
    binary search over their prefix-closed union."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        key = keys[mid - 1]
        if any(key in m for m in maps):
            lo = mid
        else:
            hi = mid - 1
    return lo
