"""Backends from DNS: stub vLLM servers on several loopback addresses (127.0.0.2, .3, ...)
sharing one port, a resolver whose answer the test changes, real requests throughout."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from router.config import build
from router.control.worker import Router
from router.fleet.discovery import Discovery, system_resolver
from tests.router.fake_kube import FakeKubeApi
from tests.stub_backend import StubBackend, stubs_on

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class FakeDns:
    """Answers like a DNS server whose records the test edits; can be made to fail."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.failing = False

    async def __call__(self, host: str, port: int) -> list[str]:
        if self.failing:
            raise OSError("SERVFAIL")
        return sorted(self.addresses)


class FlappingDns(FakeDns):
    """Fails every other answer, `times` times, then answers every time."""

    def __init__(self, addresses: list[str], times: int) -> None:
        super().__init__(addresses)
        self.left = times
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        if self.left and self.calls % 2 == 0:
            self.left -= 1
            raise OSError("SERVFAIL")
        return sorted(self.addresses)


async def until(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


def errors(router: Router) -> float:
    (family,) = router.metrics.discovery_errors.collect()
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


def members(router: Router) -> set[str]:
    return {b.name for b in router.fleet.members}


async def test_membership_follows_dns_without_dropping_requests(caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.backends")
    stubs = await stubs_on(["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    port = stubs[0].port
    dns = FakeDns(["127.0.0.2", "127.0.0.3"])
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "discovery": [{"kind": "dns", "name": "vllm.test", "port": port, "interval": 0.05}],
        "health": {"interval": 0.05},
    }
    router = Router(build(config))
    router.discovery = Discovery(router, dns)
    await router.start()
    failures: list[int] = []
    stop = asyncio.Event()

    async def steady(http: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with http.post(router.url + "/v1/chat/completions", json=CHAT) as resp:
                await resp.read()
                if resp.status != 200:
                    failures.append(resp.status)

    try:
        await until(lambda: members(router) == {f"127.0.0.{i}:{port}" for i in (2, 3)})
        async with aiohttp.ClientSession() as http:
            load = [asyncio.create_task(steady(http)) for _ in range(4)]
            await asyncio.sleep(0.2)
            dns.addresses = ["127.0.0.2", "127.0.0.4"]  # .3 vanishes, .4 appears
            await until(lambda: members(router) == {f"127.0.0.{i}:{port}" for i in (2, 4)})
            served_by_3 = len(stubs[1].received)
            await asyncio.sleep(0.3)
            dns.failing = True  # a resolver outage keeps the last good list
            await until(lambda: errors(router) >= 5)
            stop.set()
            await asyncio.gather(*load)
        warned = [r.getMessage() for r in caplog.records if "failed (" in r.getMessage()]
        assert warned == [
            "discovery from vllm.test failed (1 in a row), keeping the last list: SERVFAIL"
        ]
        dns.failing = False
        await until(lambda: any("answers again" in r.getMessage() for r in caplog.records))
        assert failures == []
        assert len(stubs[1].received) <= served_by_3 + 4  # at most what was already sent
        assert len(stubs[2].received) > 0
        assert members(router) == {f"127.0.0.{i}:{port}" for i in (2, 4)}
        text = router.metrics.render().decode()
        assert 'kvroute_discovery_errors_total{source="vllm.test"}' in text
        assert 'kvroute_discovered_backends{source="vllm.test"} 2.0' in text
        changes = [r.getMessage() for r in caplog.records if "backends (added" in r.getMessage()]
        assert f"added: http://127.0.0.4:{port}; removed: http://127.0.0.3:{port}" in changes[-1]
        assert changes[0].startswith("discovery from vllm.test: 2 backends (added: http://")
    finally:
        stop.set()
        await router.stop()
        for stub in stubs:
            await stub.stop()


async def test_a_flapping_source_warns_once_per_interval(caplog) -> None:
    """Failures with answers between them: the first is warned of (and its recovery
    logged), the next ones within the interval only counted."""
    caplog.set_level(logging.INFO, logger="kvroute.backends")
    (stub,) = await stubs_on(["127.0.0.2"])
    dns = FlappingDns(["127.0.0.2"], times=3)
    source = {"kind": "dns", "name": "vllm.test", "port": stub.port, "interval": 0.01}
    router = Router(build({"listen": {"host": "127.0.0.1", "port": 0}, "discovery": [source]}))
    router.discovery = Discovery(router, dns)
    await router.start()
    try:
        await until(lambda: errors(router) == 3 and dns.calls > 7)  # answered after the last
    finally:
        await router.stop()
        await stub.stop()
    said = [r.getMessage() for r in caplog.records if "discovery from vllm.test" in r.message]
    assert [m for m in said if "failed" in m or "again" in m] == [
        "discovery from vllm.test failed (1 in a row), keeping the last list: SERVFAIL",
        "discovery from vllm.test answers again, after 1 failures",
    ]


async def test_system_resolver_on_localhost_with_static_backends() -> None:
    (stub,) = await stubs_on(["127.0.0.1"])
    static = await StubBackend(host="127.0.0.5").start()
    assert "127.0.0.1" in await system_resolver("localhost", stub.port)
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": static.url, "name": "static"}],
        "discovery": [{"kind": "dns", "name": "localhost", "port": stub.port, "interval": 0.05}],
        "routing": {"strategy": "ROUND_ROBIN"},
    }
    router = Router(build(config))
    await router.start()
    try:
        await until(lambda: f"127.0.0.1:{stub.port}" in members(router))
        assert "static" in members(router)  # discovery adds to the static list
        async with aiohttp.ClientSession() as http:
            for _ in range(6):
                async with http.post(router.url + "/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status == 200
        assert stub.received and static.received
    finally:
        await router.stop()
        await stub.stop()
        await static.stop()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param({}, "or a discovery source", id="nothing-to-route-to"),
        pytest.param(
            {"discovery": [{"kind": "dns", "name": "x", "port": -1}]},
            "$.discovery[0].port",
            id="port",
        ),
        pytest.param({"discovery": [{"name": "x"}]}, "missing required field `kind`", id="kind"),
    ],
)
def test_discovery_config_errors(data: dict, message: str) -> None:
    from router.config import ConfigError

    with pytest.raises(ConfigError) as info:
        build(data)
    assert message in str(info.value)


async def test_kubernetes_endpointslices_list_and_watch(tmp_path) -> None:
    stubs = await stubs_on(["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    port = stubs[0].port
    api = await FakeKubeApi("sa-token").start()
    api.slices["vllm-a"] = api.slice("vllm-a", {"127.0.0.2": True, "127.0.0.3": False})
    source = api.source(tmp_path / "token", "sa-token\n", port=port)
    config = {"listen": {"host": "127.0.0.1", "port": 0}, "discovery": [source]}
    router = Router(build(config))
    await router.start()
    expect = lambda *i: {f"127.0.0.{n}:{port}" for n in i}  # noqa: E731
    try:
        await until(lambda: members(router) == expect(2))  # the not-ready one stays out
        api.events.put_nowait(
            {
                "type": "MODIFIED",
                "object": api.slice("vllm-a", {"127.0.0.2": True, "127.0.0.3": True}),
            }
        )
        await until(lambda: members(router) == expect(2, 3))
        api.events.put_nowait({"type": "ADDED", "object": api.slice("vllm-b", {"127.0.0.4": True})})
        api.events.put_nowait(
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}}
        )
        await until(lambda: members(router) == expect(2, 3, 4))
        api.events.put_nowait({"type": "DELETED", "object": api.slice("vllm-a", {})})
        await until(lambda: members(router) == expect(4))
        async with aiohttp.ClientSession() as http:
            async with http.post(router.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
        assert stubs[2].received
        # the watch ends: the router lists again and keeps following
        api.slices = {"vllm-b": api.slice("vllm-b", {"127.0.0.4": True, "127.0.0.2": True})}
        api.events.put_nowait(None)
        await until(lambda: members(router) == expect(2, 4))
        assert api.lists >= 2
    finally:
        await router.stop()
        await api.stop()
        for stub in stubs:
            await stub.stop()


async def test_kubernetes_wrong_token_keeps_the_fleet_and_counts(tmp_path) -> None:
    api = await FakeKubeApi("right").start()
    source = api.source(tmp_path / "token", "wrong")
    static = await StubBackend().start()
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": static.url, "name": "static"}],
        "discovery": [source],
    }
    router = Router(build(config))
    await router.start()
    try:
        label = 'kvroute_discovery_errors_total{source="k8s:ai/vllm"}'
        await until(lambda: label in router.metrics.render().decode())
        assert members(router) == {"static"}
    finally:
        await router.stop()
        await api.stop()
        await static.stop()
