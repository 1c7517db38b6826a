"""The prefix cache's CPU tier (`num_cpu_blocks` > 0): a victim cache of the chain
hashes the GPU evicts, least recently used first, as vLLM's offloading connector keeps
them (kv_cache.py's docstring tells the order of its events)."""

from collections import OrderedDict

from bench.sim.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVEvent


class CpuTier:
    """Up to `capacity` chain hashes the GPU evicted, with the events that announce them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: OrderedDict[int, None] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._held)

    def run(self, hashes: list[int]) -> int:
        """How many of `hashes`, from the first on, this tier holds; touched as used."""
        held = self._held
        count = 0
        for h in hashes:
            if h not in held:
                break
            held.move_to_end(h)
            count += 1
        return count

    def keep(self, h: int, events: list[KVEvent]) -> None:
        """Keep an evicted GPU block's hash, announcing it (a token-less BlockStored with
        medium CPU, block size 0, no parent) and the tier's own eviction on `events`."""
        held = self._held
        if h in held:
            held.move_to_end(h)
            return
        held[h] = None
        events.append(
            BlockStored(
                block_hashes=[h],
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium=MEDIUM_CPU,
                lora_name=None,
            )
        )
        if len(held) > self.capacity:
            old, _ = held.popitem(last=False)
            events.append(BlockRemoved(block_hashes=[old], medium=MEDIUM_CPU))

    def clear(self) -> None:
        self._held.clear()
