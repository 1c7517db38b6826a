"""The prefix cache: vLLM V1's block pool and KV cache manager, in miniature.

Algorithm (after `vllm/v1/core/block_pool.py` and `kv_cache_manager.py`):
- Physical blocks 1..N-1 (block 0 is vLLM's reserved null block). Each has a ref count
  and, once full and committed, the chain hash of the block it holds.
- ONE LRU free queue holds every block whose ref count is 0: empty blocks and cached but
  unreferenced blocks alike. Allocation pops the least recently freed block; if it still
  holds a hash, that cache entry is evicted (one BlockRemoved per hash). Blocks in use by
  running requests are never in the queue, so they are never evicted.
- A finished or preempted request frees its blocks tail first, so a prompt's last blocks
  are evicted before its first ones (shared prefixes survive longest).
- A hit is the longest run of leading chain hashes present in the cache, capped at
  (num_tokens - 1) // block_size blocks: vLLM always recomputes at least one token.
- Full blocks are committed when their slots are allocated (as vLLM does), so a request
  admitted in the same step can already hit them. A block whose hash is already cached
  by another block (two requests prefilling the same text at once) stays anonymous and
  emits nothing, which keeps the event stream consistent with the cache contents.

Usage = 1 - free/(N-1), vLLM's `kv_cache_usage_perc`: cached but evictable blocks count
as free. Cost: O(1) per block allocated, freed or looked up.

CPU tier (`num_cpu_blocks` > 0, cpu_tier.py): a victim cache. A cached block the GPU
evicts is kept in a CPU LRU of chain hashes, announced first as vLLM's offloading
connector does (a token-less BlockStored with medium CPU, block size 0, no parent) and
only then removed from the GPU, so a subscriber can resolve the CPU copy through the GPU
block it still knows. The CPU LRU's own evictions are BlockRemoved with medium CPU. A
lookup continues from the GPU's run into the blocks the CPU holds (`offloaded`); those
are loaded into new GPU blocks and committed like computed ones, and keep their CPU
copy.
"""

from collections import OrderedDict

from bench.sim.cpu_tier import CpuTier
from bench.sim.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from bench.sim.request import SimRequest


class KVCache:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, cpu_blocks: int = 0
    ) -> None:
        self.num_blocks = num_blocks
        self.cpu_blocks = cpu_blocks
        self._cpu = CpuTier(cpu_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[int, int] = {}  # chain hash -> physical block
        self._events: list[KVEvent] = []

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_cpu_cached(self) -> int:
        return len(self._cpu)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def is_cached(self, h: int) -> bool:
        return h in self._cached

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def computed_blocks(self, req: SimRequest) -> list[int]:
        """Physical blocks of the request's longest cached prefix."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def offloaded(self, req: SimRequest, start: int) -> int:
        """How many blocks from `start` on the CPU tier holds (the run after the GPU's
        hit), touched as used; capped like a hit."""
        if not self._cpu or not self.enable_prefix_caching:
            return 0
        return self._cpu.run(req.block_hashes[start : (req.num_tokens - 1) // self.block_size])

    def allocate(self, req: SimRequest, num_new_tokens: int, computed: list[int]) -> bool:
        """Give `req` the blocks for `num_new_tokens` more tokens after `computed`.

        On success the hit blocks are referenced, new blocks appended and every block that
        becomes full is committed. On failure nothing changes.
        """
        bs = self.block_size
        num_computed = req.num_computed_tokens + len(computed) * bs
        total_blocks = -(-(num_computed + num_new_tokens) // bs)
        num_needed = total_blocks - len(req.blocks) - len(computed)
        free_hits = sum(1 for b in computed if self._ref[b] == 0)
        if num_needed > len(self._free) - free_hits:
            return False
        for b in computed:
            self._touch(b)
        req.blocks.extend(computed)
        req.num_cached_blocks += len(computed)
        req.blocks.extend(self._pop_free() for _ in range(num_needed))
        if self.enable_prefix_caching:
            self._commit(req, (num_computed + num_new_tokens) // bs)
        return True

    def free(self, req: SimRequest) -> None:
        """Release the request's blocks, tail first (they stay cached until reused)."""
        for b in reversed(req.blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
        req.blocks = []
        req.num_cached_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Drop every cache entry (AllBlocksCleared); refused while any block is in use."""
        if len(self._free) != self.num_blocks - 1:
            return False
        self._hash = [None] * self.num_blocks
        self._cached.clear()
        self._cpu.clear()
        self._events.append(AllBlocksCleared())
        return True

    def _touch(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        evicted = self._hash[block]
        if evicted is not None:
            self._hash[block] = None
            del self._cached[evicted]
            if self.cpu_blocks:
                self._cpu.keep(evicted, self._events)
            self._events.append(BlockRemoved(block_hashes=[evicted], medium=MEDIUM_GPU))
        self._ref[block] = 1
        return block

    def _commit(self, req: SimRequest, num_full: int) -> None:
        end = min(num_full, len(req.block_hashes))
        run: list[int] = []  # block indices committed in one consecutive run
        for i in range(req.num_cached_blocks, end):
            h = req.block_hashes[i]
            if h in self._cached:
                self._emit_stored(req, run)
                run = []
                continue
            self._hash[req.blocks[i]] = h
            self._cached[h] = req.blocks[i]
            run.append(i)
        self._emit_stored(req, run)
        req.num_cached_blocks = max(req.num_cached_blocks, end)

    def _emit_stored(self, req: SimRequest, run: list[int]) -> None:
        if not run:
            return
        bs, first, last = self.block_size, run[0], run[-1]
        extra = [req.extra_key(i) for i in run]
        self._events.append(
            BlockStored(
                block_hashes=[req.block_hashes[i] for i in run],
                parent_block_hash=req.block_hashes[first - 1] if first else None,
                token_ids=req.token_ids[first * bs : (last + 1) * bs],
                block_size=bs,
                lora_id=req.lora_id,
                medium=MEDIUM_GPU,
                lora_name=req.lora_name,
                extra_keys=extra if any(extra) else None,
                kv_cache_spec_kind="full_attention",
            )
        )
