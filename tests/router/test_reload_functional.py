"""Hot reload from the YAML file under load: backends added, removed and re-weighted
with zero failed requests; bad configs rejected; prefixes of unchanged backends stay."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
import yaml

from hashing.ring import HashRing
from policies import RouteRequest
from router.config import ConfigError
from router.control.reload import ConfigSource
from router.control.worker import Router
from tests.router.chaos import MODEL, Tally, chat, until
from tests.router.conftest import settle
from tests.stub_backend import StubBackend

CHAT_PATH = "/v1/chat/completions"


class Rig:
    """Stub backends, a YAML file naming some of them, and a router reading it."""

    def __init__(self, path: Path, stubs: list[StubBackend], base: dict) -> None:
        self.path, self.stubs, self.base = path, stubs, base
        self.router: Router

    def write(self, members: dict[int, int], **extra) -> None:
        """Name stubs {index: weight} in the file (as s<index>), with `extra` sections."""
        backends = [
            {"url": self.stubs[i].url, "name": f"s{i}", "weight": w} for i, w in members.items()
        ]
        self.path.write_text(yaml.safe_dump({**self.base, **extra, "backends": backends}))

    async def reload(self) -> dict:
        return await self.router.reloader.reload()


@asynccontextmanager
async def rig(tmp_path: Path, n: int, members: dict[int, int], **base) -> AsyncIterator[Rig]:
    stubs = [await StubBackend().start() for _ in range(n)]
    base = {"listen": {"host": "127.0.0.1", "port": 0}, **base}
    r = Rig(tmp_path / "router.yaml", stubs, base)
    r.write(members)
    source = ConfigSource(str(r.path))
    r.router = Router(source.load(), source)
    await r.router.start()
    try:
        yield r
    finally:
        await r.router.stop()
        for stub in stubs:
            await stub.stop()


async def test_reload_under_load_loses_nothing(tmp_path: Path) -> None:
    health = {"interval": 0.05, "timeout": 0.3}
    async with rig(tmp_path, 4, {0: 1, 1: 1}, health=health) as r, aiohttp.ClientSession() as http:
        for stub in r.stubs:
            stub.behaviour.chunks, stub.behaviour.pace = 5, 0.02
        tally = Tally.new()
        url = r.router.url + CHAT_PATH
        stop = asyncio.Event()

        async def worker(i: int) -> None:
            while not stop.is_set():
                reply = await tally.send(http, url, **chat(stream=i % 2 == 0))
                assert reply.status == 200 and b'"error"' not in reply.body, reply.body

        workers = [asyncio.create_task(worker(i)) for i in range(8)]
        try:
            await asyncio.sleep(0.3)
            r.write({0: 1, 1: 1, 2: 1})
            assert (await r.reload())["added"] == ["s2"]
            await asyncio.sleep(0.3)
            await until(lambda: r.stubs[0].active > 0)  # remove s0 while it streams
            r.write({1: 1, 2: 1})
            assert (await r.reload())["removed"] == ["s0"]
            s0_bound = len(r.stubs[0].received) + r.router.fleet.retired[0].inflight
            await asyncio.sleep(0.3)
            r.write({1: 3, 2: 1, 3: 1})  # re-weight s1, add s3
            await r.reload()
            await asyncio.sleep(0.3)
            r.write({1: 3, 3: 1})
            await r.reload()
            s2_bound = len(r.stubs[2].received) + sum(b.inflight for b in r.router.fleet.retired)
            await asyncio.sleep(0.3)
        finally:
            stop.set()
            ended = await asyncio.gather(*workers, return_exceptions=True)
        assert ended == [None] * 8, ended
        await settle(r.router)
        # nothing new after removal: only what was in flight then (sent, maybe not yet read)
        assert len(r.stubs[0].received) <= s0_bound and len(r.stubs[2].received) <= s2_bound
        assert all(s.aborted == 0 for s in r.stubs)  # in-flight ones finished
        assert all(len(s.received) == s.completed for s in r.stubs)
        assert [b.name for b in r.router.fleet.members] == ["s1", "s3"]
        assert r.router.fleet.members[0].weight == 3
        assert tally.sent > 100 and (tally.failed, tally.hung) == (0, 0)


def _owners(router: Router, fingerprints: list[int]) -> list[str]:
    fleet = router.fleet
    return [
        fleet.policy.pick(RouteRequest(MODEL, fp), fleet.view(MODEL)).backend.name
        for fp in fingerprints
    ]


def _ring_owners(names: list[str], fingerprints: list[int]) -> list[str]:
    ring = HashRing([(name, 1) for name in names])
    return [names[ring.owner(fp)] for fp in fingerprints]


async def test_unchanged_backends_keep_their_prefixes(tmp_path: Path) -> None:
    """PREFIX_AWARE: a backend added takes about 1/4 of the new prefixes, the ones its
    ring points own; a prefix already placed stays where it went (its backend holds it);
    removing the backend puts its prefixes back on their owners."""
    routing = {"strategy": "PREFIX_AWARE", "concurrency_threshold": None}
    three, four = ["s0", "s1", "s2"], ["s0", "s1", "s2", "s3"]
    async with rig(tmp_path, 4, {0: 1, 1: 1, 2: 1}, routing=routing) as r:
        policy = r.router.fleet.policy
        placed, new = ([random.getrandbits(64) for _ in range(2000)] for _ in range(2))
        before = _owners(r.router, placed)
        assert before == _ring_owners(three, placed)
        r.write({0: 1, 1: 1, 2: 1, 3: 1}, routing=routing)
        await r.reload()
        assert r.router.fleet.policy is policy  # same routing: the policy object stays
        assert _owners(r.router, placed) == before
        after = _owners(r.router, new)
        assert after == _ring_owners(four, new)
        moved = [a for b, a in zip(_ring_owners(three, new), after, strict=True) if a != b]
        assert set(moved) == {"s3"}  # keys only move to the new backend
        assert 0.15 < len(moved) / len(new) < 0.35  # about 1/4
        r.write({0: 1, 1: 1, 2: 1}, routing=routing)
        await r.reload()
        assert _owners(r.router, placed) == before
        assert _owners(r.router, new) == _ring_owners(three, new)  # removing it puts them back


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("backends: [", "router.yaml:1:12: expected the node", id="bad-yaml"),
        pytest.param("backends: []\n", "at least one backend", id="no-backends"),
        pytest.param("backends: [{url: 'http://a:1'}]\nroutng: {}\n", "routng", id="typo"),
        pytest.param(
            "backends: [{url: 'http://a:1'}, {url: 'http://a:1'}]\n", "duplicate", id="dup"
        ),
        pytest.param(
            "backends: [{url: 'http://a:1'}]\nauth: {enabled: true, tokens_env: KV_NOT_SET}\n",
            "KV_NOT_SET",
            id="missing-secret",
        ),
    ],
)
async def test_an_invalid_config_is_rejected_and_the_old_one_serves(
    tmp_path: Path, caplog, text: str, message: str
) -> None:
    async with rig(tmp_path, 1, {0: 1}) as r, aiohttp.ClientSession() as http:
        r.path.write_text(text)
        with (
            caplog.at_level(logging.ERROR, "kvroute.config"),
            pytest.raises(ConfigError, match=message),
        ):
            await r.reload()
        assert "reload rejected, the old config keeps serving" in caplog.text
        tally = Tally.new()
        reply = await tally.send(http, r.router.url + CHAT_PATH, **chat())
        assert reply.headers["x-kvroute-backend"] == "s0"
        assert (tally.failed, tally.hung) == (0, 0)


async def test_socket_bound_settings_wait_for_a_restart(tmp_path: Path) -> None:
    async with rig(tmp_path, 1, {0: 1}) as r:
        listen = r.router.config.listen
        r.write(
            {0: 1},
            listen={"host": "127.0.0.1", "port": 1},
            limits={"max_body_bytes": 4096, "queue_size": 3},
            retries={"max_retries": 1},
            routing={"strategy": "ROUND_ROBIN"},
        )
        report = await r.reload()
        assert set(report["at_restart"]) == {"listen", "limits.max_body_bytes"}
        assert r.router.dispatcher.strategy == "ROUND_ROBIN"  # a new policy, live
        config = r.router.config
        assert config.listen == listen and config.limits.max_body_bytes == 16 * 1024 * 1024
        assert config.limits.queue_size == 3 and config.retries.max_retries == 1  # live
        assert r.router.dispatcher.admission.limits.queue_size == 3
        await settle(r.router)
