"""With auth on, what a stranger gets from every route the router serves: a 401.

The routes are read from the running router itself - the data listener's aiohttp app,
the fast path's routes (router/ingress/fast.py answers those before aiohttp sees them),
the admin listener's app, and every method of every gRPC service it registers - and each
is called over a real socket with no token (admin: no admin token). Only the probes and
the scraper's page answer: `/health`, `/ready`, `/metrics`, and gRPC health. So a route
added later is covered by construction.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import aiohttp
import grpc
import pytest
from aiohttp import web
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from router.control.worker import Router
from router.ingress import fast as fast_ingress
from router.ingress.grpc_service import SERVICES
from tests.router.chaos import Tally, chat
from tests.router.conftest import running

ADMIN_TOKEN = "admin-token-for-the-walk"
DATA_TOKEN = "data-token-for-the-walk"
#: the probes and the scraper's page: open with auth on
OPEN = frozenset({"/health", "/ready", "/metrics"})
OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})
TIMEOUT = 10.0


@pytest.fixture
def config(monkeypatch) -> dict:
    monkeypatch.setenv("KV_WALK_ADMIN", ADMIN_TOKEN)
    monkeypatch.setenv("KV_WALK_DATA", f"{DATA_TOKEN} acme")
    return {
        "admin": {"port": 0, "token_env": "KV_WALK_ADMIN"},
        "auth": {"enabled": True, "tokens_env": "KV_WALK_DATA"},
        "grpc": {"enabled": True, "port": 0},
    }


def routes(app: web.Application) -> Iterator[tuple[str, str]]:
    """(method, path) of every route of `app`, its placeholders filled in; a route for
    any method is called as GET and as POST."""
    for resource in app.router.resources():
        path = re.sub(r"\{[^}]*\}", "x", resource.canonical)
        for route in resource:
            yield from (
                ((m, path) for m in ("GET", "POST"))
                if route.method == "*"
                else ((route.method, path),)
            )


def data_routes(router: Router) -> set[tuple[str, str]]:
    fast = {("POST", path) for path in fast_ingress.ROUTES}
    return set(routes(router._runner.app)) | fast


async def walk(http: aiohttp.ClientSession, base: str, paths: set[tuple[str, str]]) -> dict:
    """Each route's status, called with no Authorization header."""
    tally = Tally.new()
    statuses = {}
    for method, path in sorted(paths):
        reply = await tally.send(http, base + path, method=method, expect=None, **chat())
        statuses[method, path] = reply.status
        if reply.status == 401 and method != "HEAD":
            assert reply.json()["error"]["code"] == 401, (method, path)
            assert reply.headers["WWW-Authenticate"].startswith("Bearer"), (method, path)
    assert tally.hung == 0
    return statuses


def expected(paths: set[tuple[str, str]], open_status: dict[str, int]) -> dict:
    return {(m, p): open_status.get(p, 401) for m, p in paths}


@pytest.mark.parametrize("listen", ["data", "admin"], ids=["metrics-on-data", "metrics-on-admin"])
async def test_every_http_route_but_the_probes_needs_a_token(config, listen: str) -> None:
    async with (
        running(1, metrics={"listen": listen}, **config) as (router, stubs),
        aiohttp.ClientSession() as http,
    ):
        data = data_routes(router)
        admin = set(routes(router.admin._runner.app))
        assert ("POST", "/debug/routing") not in data and ("GET", "/debug/routing") in data
        assert {p for _, p in admin} >= {"/admin/backends", "/admin/reload"}
        scraped = {"/metrics": 200}
        data_open = {"/health": 200, "/ready": 200, **(scraped if listen == "data" else {})}
        assert await walk(http, router.url, data) == expected(data, data_open)
        admin_open = scraped if listen == "admin" else {}
        assert await walk(http, router.admin.url, admin) == expected(admin, admin_open)
        assert stubs[0].received == []  # nothing reached a backend


#: paths and methods no route serves: with auth on, a 401 too (a 404 or 405 with a token)
UNROUTED = frozenset(
    {
        ("GET", "/v1/chat/completions"),
        ("PATCH", "/v1/embeddings"),
        ("PUT", "/v1/models"),
        ("DELETE", "/v1/files/file-x"),
        ("POST", "/admin/backends"),
        ("GET", "/v1/completions/x"),
        ("OPTIONS", "/nope"),
        ("HEAD", "/.env"),
    }
)


async def test_a_path_or_method_no_route_serves_needs_a_token_too(config) -> None:
    """Without a token, a route cannot be told from no route: both answer 401."""
    async with (
        running(1, **config) as (router, stubs),
        aiohttp.ClientSession() as http,
    ):
        assert not UNROUTED & data_routes(router)
        assert await walk(http, router.url, set(UNROUTED)) == expected(set(UNROUTED), {})
        token = {"Authorization": f"Bearer {DATA_TOKEN}"}
        for method, path in sorted(UNROUTED):
            async with http.request(method, router.url + path, headers=token) as reply:
                assert reply.status in (404, 405), (method, path)
        assert stubs[0].received == []


async def call(channel: grpc.aio.Channel, service: ServiceDescriptor, method: MethodDescriptor):
    """Call `method` with an empty message and no metadata: its status code (OK once its
    first answer came)."""
    path = f"/{service.full_name}/{method.name}"
    streaming = method.client_streaming, method.server_streaming
    make = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[streaming]
    rpc = make(path)(iter([b""]) if method.client_streaming else b"", timeout=TIMEOUT)
    try:
        if method.server_streaming:
            await rpc.read()
        else:
            await rpc
    except grpc.aio.AioRpcError as err:
        return err.code()
    finally:
        rpc.cancel()
    return grpc.StatusCode.OK


async def test_every_grpc_method_but_health_needs_a_token(config) -> None:
    async with running(1, **config) as (router, stubs):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
            got = {
                (s.full_name, m.name): await call(channel, s, m)
                for s in SERVICES
                for m in s.methods
            }
        refused = {key for key, code in got.items() if code == grpc.StatusCode.UNAUTHENTICATED}
        closed = {key for key in got if key[0] not in OPEN_SERVICES}
        assert refused == closed
        assert got["grpc.health.v1.Health", "Check"] == grpc.StatusCode.OK
        assert len(got) >= 7  # Inference's four, health's two, reflection's one
        assert stubs[0].received == []
