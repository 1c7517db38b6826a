"""A router process keeps the heap memory a new long prompt freed for the next one,
instead of faulting its pages in anew for each (router/control/heap.py)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import psutil

from tests.router.test_workers import CHAT, backends, chat, multi_router, stubs

WORDS = 100_000  # a ~500 KB body: each of its copies is past glibc's first mmap threshold


def minor_faults(root: int) -> int:
    """Page faults served without I/O, summed over `root` and its children (/proc)."""
    pids = [root, *(c.pid for c in psutil.Process(root).children(recursive=True))]
    total = 0
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat").read_text()
        total += int(stat.rsplit(")", 1)[1].split()[7])
    return total


async def test_new_long_prompts_reuse_the_memory_the_last_ones_freed(tmp_path) -> None:
    servers = await stubs(1)
    try:
        async with (
            multi_router(tmp_path, {"backends": backends(servers)}) as router,
            aiohttp.ClientSession() as http,
        ):

            async def send(i: int) -> None:
                body = chat(f"document {i}: " + "word " * WORDS)
                async with http.post(router.url + CHAT, json=body) as resp:
                    assert resp.status == 200, await resp.text()

            for i in range(5):  # the heaps grow to what a long prompt takes
                await send(i)
            before = minor_faults(router.proc.pid)
            for i in range(5, 25):
                await send(i)
            per_prompt = (minor_faults(router.proc.pid) - before) / 20
        # ~350 a prompt when each freed copy goes back to the kernel
        assert per_prompt < 50, f"{per_prompt:.0f} page faults a new long prompt"
    finally:
        for s in servers:
            await s.stop()
