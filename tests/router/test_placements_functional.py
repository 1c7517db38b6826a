"""One view of where prefixes live, across a router's workers and across replicas.

Real routers (`kvroute serve`, two workers, no KV events: approximate mode, vLLM's
default) in front of stub backends on 127.0.0.1; real sockets, aiohttp clients pinned to
one worker each (tests/router/test_workers.py `MultiRouter.pinned`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from bench.harness.processes import free_port, process, wait_ready
from hashing.canonical import Message
from hashing.chat_tokens import PromptBlocks
from hashing.prefix_index import PrefixIndex
from router.config import APPROXIMATE_BLOCK_SIZE
from tests.router.test_workers import CHAT, backends, chat, metric, multi_router, stubs, until
from tests.stub_backend import Behaviour, StubBackend

pytestmark = pytest.mark.timeout(120)

DOCUMENT = "clause {i}: the lessee shall keep the premises in good and tenantable repair. "


def _document(doc: int, question: str = "summarise") -> str:
    return "".join(DOCUMENT.format(i=f"{doc}.{i}") for i in range(160)) + question


async def _home(session: aiohttp.ClientSession, url: str, prompt: str) -> str:
    """Where `prompt` went; its answer is short (8 tokens): staying beside a burst of
    the same document costs less than prefilling the document again elsewhere."""
    async with session.post(url + CHAT, json={**chat(prompt), "max_tokens": 8}) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-kvroute-backend"]


async def _speculative(session: aiohttp.ClientSession, url: str) -> dict[str, int]:
    """Speculative index keys per backend, as the worker behind `session` sees them."""
    async with session.get(url + "/debug/routing") as resp:
        state = await resp.json()
    return {name: b["index_keys"][1] for name, b in state["backends"].items()}


async def test_a_burst_of_one_new_prefix_through_every_worker_lands_on_one_backend(
    tmp_path,
) -> None:
    """Eight requests of one new document, held open at the backends, sent at once over
    four connections per worker: each worker's index finds the document cold, yet the
    burst stays on one backend (the shared placements and the agreed cold choice)."""
    servers = await stubs(4, Behaviour(chunks=2, pace=20.0))
    config = {"backends": backends(servers), "routing": {"strategy": "KV_AWARE"}}
    try:
        async with multi_router(tmp_path, config) as r:
            sessions = [await r.pinned(pid) for pid in r.workers() for _ in range(4)]
            for doc in range(3):
                prompts = [_document(doc, f"question {q}") for q in range(len(sessions))]
                homes = await asyncio.gather(
                    *(_home(s, r.url, p) for s, p in zip(sessions, prompts, strict=True))
                )
                assert len(set(homes)) == 1, (doc, homes)
    finally:
        for s in servers:
            await s.stop()


async def test_what_one_worker_learns_reaches_the_other(tmp_path) -> None:
    """A conversation's first turn through worker 0 is learned by worker 1's own index
    (the broadcast, not a shared lookup), so its next turn through worker 1 goes to the
    same backend, whichever it is."""
    servers = await stubs(4)
    config = {"backends": backends(servers), "routing": {"strategy": "KV_AWARE"}}
    try:
        async with multi_router(tmp_path, config) as r:
            first, second = [await r.pinned(pid) for pid in r.workers()]
            for doc in range(6):
                before = await _speculative(second, r.url)
                home = await _home(first, r.url, _document(doc))

                async def learned(h: str = home, seen: dict = before) -> bool:
                    return (await _speculative(second, r.url))[h] > seen[h]

                await until(learned, 10, "worker 1 to learn worker 0's placement")
                follow_up = _document(doc) + " and now list the lessee's duties"
                assert await _home(second, r.url, follow_up) == home
    finally:
        for s in servers:
            await s.stop()


async def test_the_workers_and_the_collector_keep_one_index(tmp_path) -> None:
    """The prefix index is one file in the run directory that every worker maps: the
    keys a request through either worker placed are in it, as a third process opening
    it reads them, and the index's gauge, summed over the processes, is that one
    table's size (each process with its own copy would show about three times it)."""
    servers = await stubs(4)
    config = {"backends": backends(servers), "routing": {"strategy": "KV_AWARE"}}
    try:
        async with multi_router(tmp_path, config) as r:
            (rundir,) = (tmp_path / "run").glob("kvroute-*")
            path = rundir / "index-gpu"
            for pid in r.workers():
                maps = Path(f"/proc/{pid}/maps").read_text()
                assert str(path) in maps, pid
            sessions = [await r.pinned(pid) for pid in r.workers()]
            index = _opened(path)
            for doc, session in enumerate(sessions):
                home = await _home(session, r.url, _document(doc))
                messages = [Message("user", _document(doc))]
                block = APPROXIMATE_BLOCK_SIZE  # without KV events: the router's own, of the text
                keys = PromptBlocks(block, 32768 // block, text_keys=True)
                blocks = keys.chat("stub-model", None, messages)[0]
                assert index.longest_prefix(blocks, home) == len(blocks) > 0, doc
            media = [_opened(found) for found in rundir.glob("index-*")]
            assert len(media) == 3  # the GPU's, and the default CPU and storage tiers'

            async def counted_once() -> bool:
                shown = await metric(sessions[0], r.url, "kvroute_prefix_index_bytes")
                return shown == sum(medium.nbytes for medium in media)

            await until(counted_once, 10, "the index's gauge to show one table")
    finally:
        for s in servers:
            await s.stop()


def _opened(path: Path) -> PrefixIndex:
    """The shared index file at `path`, mapped by this process too."""
    index = PrefixIndex()
    index.share(str(path))
    return index


@contextlib.asynccontextmanager
async def _replicas(tmp_path, config: dict, count: int) -> AsyncIterator[list[str]]:
    """`count` routers started from one config file, each with its default workers."""
    import yaml

    path = tmp_path / "replica.yaml"
    path.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1"}, **config}))
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(count):
            port = free_port()
            cmd = ["serve", "-c", str(path), "--port", str(port), "--log-level", "warning"]
            stack.enter_context(process([*_kvroute(), *cmd]))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            await wait_ready(url, timeout=30)
        yield urls


def _kvroute() -> list[str]:
    import sys

    return [sys.executable, "-m", "router"]


@pytest.mark.parametrize(
    "routing",
    [
        pytest.param({"strategy": "KV_AWARE"}, id="kv-aware"),
        pytest.param({"strategy": "PREFIX_AWARE", "prefix_length": 64}, id="prefix-aware"),
    ],
)
async def test_two_replicas_place_new_prefixes_identically(tmp_path, routing: dict) -> None:
    """No shared state between two routers: 40 new prefixes, each sent to one replica
    and then the other, land on the same backend from both, spread over the fleet."""
    servers: list[StubBackend] = await stubs(4)
    config = {"backends": backends(servers), "routing": routing}
    try:
        async with _replicas(tmp_path, config, 2) as urls, aiohttp.ClientSession() as session:
            placed = []
            for doc in range(40):
                homes = [await _home(session, url, _document(100 + doc)) for url in urls]
                assert homes[0] == homes[1], (doc, homes)
                placed.append(homes[0])
            assert len(set(placed)) == 4, placed
    finally:
        for s in servers:
            await s.stop()


async def test_prefix_aware_a_prefix_moved_through_one_worker_stays_put_through_the_other(
    tmp_path,
) -> None:
    """PREFIX_AWARE, two workers: through worker 0 a document fills its owner (held open
    at the backend, at `concurrency_threshold`), so its next request moves to another
    backend. Once every request has finished, the document's next request through
    worker 1 goes where worker 0 moved it, not back to its free owner."""
    gate = asyncio.Event()
    servers = await stubs(4, Behaviour(gate=gate))
    routing = {
        "strategy": "PREFIX_AWARE",
        "prefix_length": 64,
        "concurrency_threshold": 2,
        "load_factor": None,
    }
    config = {"backends": backends(servers), "routing": routing}
    try:
        async with multi_router(tmp_path, config) as r:
            zero, one = r.workers()
            *firsts, first = [await r.pinned(zero) for _ in range(3)]  # a connection each
            second = await r.pinned(one)
            held = [asyncio.create_task(_home(s, r.url, _document(7))) for s in firsts]
            await until(lambda: max(s.active for s in servers) == 2, 10, "the owner full")
            owner = f"b{[s.active for s in servers].index(2)}"
            moved = asyncio.create_task(_home(first, r.url, _document(7)))
            await until(lambda: sum(s.active for s in servers) == 3, 10, "the third held")
            gate.set()
            assert await asyncio.gather(*held) == [owner, owner]
            elsewhere = await moved
            assert elsewhere != owner
            await until(lambda: sum(s.active for s in servers) == 0, 10, "all finished")
            assert await _home(second, r.url, _document(7)) == elsewhere
            assert await _home(first, r.url, _document(7)) == elsewhere
    finally:
        gate.set()
        for s in servers:
            await s.stop()
