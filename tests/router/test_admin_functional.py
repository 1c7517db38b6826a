"""The admin API on its own listener: its token, the backend list, drain, add, remove,
the effective config; real stub backends and a real router on 127.0.0.1."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.config import ConfigError, build
from router.control.worker import Router
from router.ingress.auth import issue
from tests.router.chaos import Tally, chat, until
from tests.router.conftest import running, settle
from tests.stub_backend import StubBackend

ADMIN_TOKEN = "admin-token-for-tests"
DATA_TOKEN = "data-token-for-tests"
KEY = "k" * 40
CHAT_PATH = "/v1/chat/completions"


@pytest.fixture
def config(monkeypatch) -> dict:
    monkeypatch.setenv("KV_ADMIN", ADMIN_TOKEN)
    monkeypatch.setenv("KV_DATA", DATA_TOKEN)
    monkeypatch.setenv("KV_KEY", KEY)
    return {
        "admin": {"port": 0, "token_env": "KV_ADMIN"},
        "auth": {"enabled": True, "tokens_env": "KV_DATA", "signing_key_env": "KV_KEY"},
        "health": {"interval": 0.05, "timeout": 0.3},
    }


class Admin:
    """A client of one router's admin API, counting its requests in a Tally."""

    def __init__(self, router: Router, http: aiohttp.ClientSession, tally: Tally) -> None:
        self.url = router.admin.url
        self.http = http
        self.tally = tally

    async def __call__(self, method: str, path: str, expect: int = 200, token=ADMIN_TOKEN, **kw):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        reply = await self.tally.send(
            self.http, self.url + path, method=method, expect=expect, headers=headers, **kw
        )
        return reply.json()


def _data(token: str = DATA_TOKEN) -> dict:
    return {"headers": {"Authorization": f"Bearer {token}"}, **chat()}


async def test_admin_needs_its_own_token(config) -> None:
    async with running(1, **config) as (router, _), aiohttp.ClientSession() as http:
        admin = Admin(router, http, Tally.new())
        assert (await admin("GET", "/admin/backends", 401, token=None))["error"]["code"] == 401
        await admin("GET", "/admin/backends", 401, token="wrong")
        await admin("GET", "/admin/backends", 401, token=DATA_TOKEN)  # data-plane token
        signed = issue(KEY.encode(), "acme", 600)
        await admin("GET", "/admin/config", 401, token=signed)
        await admin("POST", "/admin/backends/b0/drain", 401, token=DATA_TOKEN)
        assert router.fleet.members[0].usable  # nothing happened
        rows = (await admin("GET", "/admin/backends"))["backends"]
        assert rows[0]["name"] == "b0" and rows[0]["state"] == "active"
        assert rows[0]["breaker"] == "closed" and rows[0]["inflight"] == 0
        # and the data plane refuses the admin token
        reply = await admin.tally.send(
            http, router.url + CHAT_PATH, expect=401, **_data(ADMIN_TOKEN)
        )
        assert reply.json()["error"]["type"] == "AuthenticationError"
        assert (admin.tally.failed, admin.tally.hung) == (0, 0)


def test_an_admin_token_that_is_also_a_data_token_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("KV_SAME", "same-token")
    config = build(
        {
            "backends": [{"url": "http://127.0.0.1:1"}],
            "admin": {"token_env": "KV_SAME"},
            "auth": {"enabled": True, "tokens_env": "KV_SAME"},
        }
    )
    with pytest.raises(ConfigError, match="admin token"):
        Router(config)


async def test_drain_keeps_the_ring_place_and_undrain_brings_prefixes_back(config) -> None:
    routing = {"strategy": "PREFIX_AWARE", "concurrency_threshold": None}
    async with running(3, routing, **config) as (router, _), aiohttp.ClientSession() as http:
        tally = Tally.new()
        admin = Admin(router, http, tally)
        url = router.url + CHAT_PATH
        owner = (await tally.send(http, url, **_data())).headers["x-kvroute-backend"]
        drained = await admin("POST", f"/admin/backends/{owner}/drain")
        assert drained["state"] == "draining" and not drained["usable"]
        during = {(await tally.send(http, url, **_data())).headers["x-kvroute-backend"]}
        assert owner not in during and len(during) == 1  # the next on the ring, stably
        await admin("POST", f"/admin/backends/{owner}/undrain")
        after = (await tally.send(http, url, **_data())).headers["x-kvroute-backend"]
        assert after == owner
        await admin("POST", "/admin/backends/nope/drain", 404)
        assert (tally.failed, tally.hung) == (0, 0)


async def test_add_and_remove_without_losing_requests(config) -> None:
    async with (
        running(2, {"strategy": "ROUND_ROBIN"}, **config) as (router, stubs),
        aiohttp.ClientSession() as http,
    ):
        tally = Tally.new()
        admin = Admin(router, http, tally)
        url = router.url + CHAT_PATH
        extra = await StubBackend().start()
        try:
            added = await admin(
                "POST", "/admin/backends", 201, json={"url": extra.url, "name": "x"}
            )
            assert added["added"] == ["x"]
            names = [r["name"] for r in (await admin("GET", "/admin/backends"))["backends"]]
            assert names == ["b0", "b1", "x"]
            # its first health check can miss its 0.3 s timeout on a loaded machine: then
            # it joins once the ordinary checks pass
            await until(lambda: router.fleet.find("x").usable)
            served = {(await tally.send(http, url, **_data())).headers["x-kvroute-backend"]}
            for _ in range(5):
                served.add((await tally.send(http, url, **_data())).headers["x-kvroute-backend"])
            assert served == {"b0", "b1", "x"}

            # remove b0 while it streams: the stream ends normally, nothing new goes there
            stubs[0].behaviour.chunks, stubs[0].behaviour.pace = 6, 0.1
            stream = {**_data(), "json": {**_data()["json"], "stream": True}}
            streams = []
            for _ in range(3):
                streams.append(asyncio.create_task(tally.send(http, url, **stream)))
            await until(lambda: stubs[0].active == 1)
            before = len(stubs[0].received)
            removed = await admin("DELETE", "/admin/backends/b0")
            assert removed["removed"] == ["b0"]
            rows = {r["name"]: r for r in (await admin("GET", "/admin/backends"))["backends"]}
            assert rows["b0"]["state"] == "retiring" and rows["b0"]["inflight"] == 1
            for _ in range(6):
                await tally.send(http, url, **_data())
            replies = await asyncio.gather(*streams)
            assert all(r.events()[-1] == b"[DONE]" and b"error" not in r.body for r in replies)
            assert len(stubs[0].received) == before and stubs[0].aborted == 0
            await settle(router)
            assert router.fleet.retired == () or all(b.inflight == 0 for b in router.fleet.retired)
            names = [r["name"] for r in (await admin("GET", "/admin/backends"))["backends"]]
            assert names == ["b1", "x"]
            effective = await admin("GET", "/admin/config")
            assert [b["name"] for b in effective["backends"]] == ["b1", "x"]
            assert effective["admin"]["token_env"] == "KV_ADMIN"
            assert ADMIN_TOKEN not in str(effective) and DATA_TOKEN not in str(effective)
        finally:
            await extra.stop()
        # refused edits leave everything as it was
        bad = await admin("POST", "/admin/backends", 400, json={"url": "ftp://x"})
        assert "must look like http" in bad["error"]["message"]
        await admin("POST", "/admin/backends", 400, json={"url": stubs[1].url})  # duplicate
        await admin("POST", "/admin/backends", 400, data=b"[not json")
        await admin("DELETE", "/admin/backends/nope", 404)
        await admin("DELETE", "/admin/backends/x")
        await admin("DELETE", "/admin/backends/b1", 400)  # the last one stays
        await admin("POST", "/admin/reload", 400)  # this router has no file to re-read
        assert [b.name for b in router.fleet.members] == ["b1"]
        assert (tally.failed, tally.hung) == (0, 0)


@pytest.mark.parametrize("listen", ["data", "admin"])
async def test_metrics_are_served_where_metrics_listen_says(config, listen: str) -> None:
    """`metrics: {listen: admin}`: the admin listener serves /metrics with no token (the
    scraper's), the data port answers 404; by default the data port serves it and the
    admin listener has no such route."""
    async with (
        running(1, metrics={"listen": listen}, **config) as (router, _),
        aiohttp.ClientSession() as http,
    ):
        tally = Tally.new()
        admin = Admin(router, http, tally)
        await tally.send(http, router.url + CHAT_PATH, **_data())
        await settle(router)  # accounted once the exchange is over
        here, there = router.admin.url, router.url
        if listen == "data":
            here, there = there, here
        page = await tally.send(http, here + "/metrics", method="GET")
        assert page.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        served = [
            s.value
            for family in text_string_to_metric_families(page.body.decode())
            for s in family.samples
            if s.name == "kvroute_requests_total" and s.value  # not the ones at 0
        ]
        assert served == [1.0]
        gone = 401 if listen == "data" else 404  # the admin listener wants its token first
        missing = await tally.send(http, there + "/metrics", method="GET", expect=gone)
        assert missing.json()["error"]["code"] == gone
        if listen == "data":
            await admin("GET", "/metrics", 404)
        await admin("GET", "/admin/backends", 401, token=None)  # the rest stays closed
        assert (tally.failed, tally.hung) == (0, 0)


async def test_debug_routing_needs_the_admin_token_when_auth_is_on(config) -> None:
    """It shows every tenant's recent requests: no data-plane token opens it."""
    async with running(1, **config) as (router, _), aiohttp.ClientSession() as http:
        tally = Tally.new()
        url = router.url + "/debug/routing"
        await tally.send(http, router.url + CHAT_PATH, **_data())  # a decision to show
        for headers in ({}, _data()["headers"], {"Authorization": "Bearer wrong"}):
            refused = await tally.send(http, url, method="GET", expect=401, headers=headers)
            assert refused.json()["error"]["type"] == "AuthenticationError"
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        shown = await tally.send(http, url, method="GET", headers=admin)
        assert set(shown.json()["backends"]) == {"b0"}
        assert (tally.failed, tally.hung) == (0, 0)


@pytest.mark.parametrize("auth", [True, False], ids=["auth-on-no-admin", "auth-off"])
async def test_debug_routing_without_an_admin_section(config, auth: bool) -> None:
    """Auth on and no admin API: no token opens it. Auth off: open, as it always was."""
    settings = {"auth": config["auth"]} if auth else {}
    async with running(1, **settings) as (router, _), aiohttp.ClientSession() as http:
        tally = Tally.new()
        url = router.url + "/debug/routing"
        expect = 401 if auth else 200
        for headers in ({}, _data()["headers"], {"Authorization": f"Bearer {ADMIN_TOKEN}"}):
            reply = await tally.send(http, url, method="GET", expect=expect, headers=headers)
            if auth:
                assert "no admin API" in reply.json()["error"]["message"]
        assert (tally.failed, tally.hung) == (0, 0)
