"""Auth on the data plane over real sockets: refused and accepted tokens, tenants."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from openai import AsyncOpenAI, AuthenticationError
from prometheus_client.parser import text_string_to_metric_families

from router.ingress.auth import issue
from tests.router.chaos import MODEL, Tally, chat, until
from tests.router.conftest import running, settle

KEY = "s" * 40
STATIC = "static-token-for-tests"
ANONYMOUS = "static-token-without-a-tenant"
CHAT_PATH = "/v1/chat/completions"


@pytest.fixture
def secrets(monkeypatch) -> dict:
    monkeypatch.setenv("KV_TEST_KEY", KEY)
    monkeypatch.setenv("KV_TEST_TOKENS", f"{STATIC} team-a,{ANONYMOUS}")
    return {"enabled": True, "tokens_env": "KV_TEST_TOKENS", "signing_key_env": "KV_TEST_KEY"}


def _auth(token: str) -> dict:
    return {"headers": {"Authorization": f"Bearer {token}"}}


def _expired() -> str:
    return issue(KEY.encode(), "acme", 60, now=1_000_000)


def _tampered() -> str:
    token = issue(KEY.encode(), "acme", 600)
    return token[:-3] + ("abc" if not token.endswith("abc") else "xyz")


def _padded() -> str:
    return issue(KEY.encode(), "acme", 600) + "="


async def _raw(router, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """One request as raw bytes on a new connection: the status and the JSON body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    try:
        async with asyncio.timeout(5):
            writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            status = int((await reader.readline()).split()[1])
            headers = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
            length = int(headers.split("content-length:")[1].split("\r\n")[0])
            return status, orjson.loads(await reader.readexactly(length))
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        pytest.param({}, "Missing bearer token", id="missing"),
        pytest.param({"Authorization": "Basic dXNlcjpwYXNz"}, "Malformed", id="not-bearer"),
        pytest.param({"Authorization": "Bearer nope"}, "Invalid bearer token", id="wrong"),
        pytest.param({"Authorization": f"Bearer {_expired()}"}, "expired", id="expired"),
        pytest.param({"Authorization": f"Bearer {_tampered()}"}, "Invalid", id="tampered"),
        pytest.param({"Authorization": f"Bearer {_padded()}"}, "Invalid", id="padded"),
    ],
)
async def test_bad_tokens_get_an_openai_style_401(secrets, headers, message) -> None:
    async with running(1, auth=secrets) as (router, stubs), aiohttp.ClientSession() as http:
        tally = Tally.new()
        url = router.url + "/v1/chat/completions"
        reply = await tally.send(http, url, expect=401, headers=headers, **chat())
        error = reply.json()["error"]
        assert error["type"] == "AuthenticationError" and message in error["message"]
        assert reply.headers["WWW-Authenticate"] == "Bearer"
        await tally.send(http, router.url + "/v1/models", expect=401, method="GET", headers=headers)
        assert stubs[0].received == []
        assert (tally.failed, tally.hung) == (0, 0)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        pytest.param(b"POST", b"/v1/chat/completions", id="fast-path"),
        pytest.param(b"GET", b"/v1/models", id="aiohttp"),
    ],
)
async def test_a_token_that_is_not_utf8_is_a_401(secrets, method, path) -> None:
    """Header bytes that are not UTF-8 reach the check as surrogates: still a 401."""
    async with running(1, auth=secrets) as (router, stubs):
        for token in (b"\xff\xfe", STATIC.encode() + b"\xff", b"kvr1.\xff.\xfe"):
            head = b"%s %s HTTP/1.1\r\nHost: kvroute\r\n" % (method, path)
            head += b"Authorization: Bearer %s\r\n" % token
            status, body = await _raw(router, head, orjson.dumps(chat()["json"]))
            assert (status, body["error"]["type"]) == (401, "AuthenticationError")
        assert stubs[0].received == []


@pytest.mark.parametrize(
    ("method", "path"),
    [
        pytest.param(b"POST", b"/v1/chat/completions", id="fast-path"),
        pytest.param(b"GET", b"/v1/models", id="aiohttp"),
    ],
)
async def test_a_tenant_header_that_is_not_a_tenant_id_is_a_400(method, path) -> None:
    """With auth off the tenant header is the tenant: bytes that are no tenant id (not
    UTF-8, too long) are refused before they salt a fingerprint or name a slot."""
    routing = {"strategy": "PREFIX_AWARE"}  # its fingerprint is salted with the tenant
    async with running(1, routing, tenant_header="X-Tenant-Id") as (router, stubs):
        for tenant in (b"a\xff\xfe", b"t" * 65, b"two words"):
            head = b"%s %s HTTP/1.1\r\nHost: kvroute\r\n" % (method, path)
            head += b"X-Tenant-Id: %s\r\n" % tenant
            status, body = await _raw(router, head, orjson.dumps(chat()["json"]))
            assert (status, body["error"]["type"]) == (400, "BadRequestError")
        assert stubs[0].received == []
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvroute\r\nX-Tenant-Id: acme\r\n"
        status, _ = await _raw(router, head, orjson.dumps(chat()["json"]))
        assert status == 200


async def test_valid_tokens_pass_and_set_the_tenant(secrets) -> None:
    metrics = {"tenants": ["acme"]}
    async with (
        running(1, auth=secrets, metrics=metrics) as (router, stubs),
        aiohttp.ClientSession() as http,
    ):
        tally = Tally.new()
        url = router.url + "/v1/chat/completions"
        signed = issue(KEY.encode(), "acme", 600)
        await tally.send(http, url, **_auth(signed), **chat())
        await tally.send(http, url, **_auth(STATIC), **chat())
        assert all("Authorization" not in h for h in stubs[0].headers)  # never forwarded
        for path in ("/health", "/ready", "/metrics"):  # probes and scrapes stay open
            await tally.send(http, router.url + path, method="GET")
        reply = await tally.send(http, router.url + "/metrics", method="GET")
        text = reply.body.decode()
        assert 'kvroute_tenant_requests_total{tenant="acme"} 1.0' in text
        assert 'kvroute_tenant_requests_total{tenant="team-a"} 1.0' in text
        async with AsyncOpenAI(base_url=router.url + "/v1", api_key=signed, max_retries=0) as oai:
            messages = chat()["json"]["messages"]
            answer = await oai.chat.completions.create(model=MODEL, messages=messages)
        assert answer.choices[0].message.content
        async with AsyncOpenAI(
            base_url=router.url + "/v1", api_key="bad", max_retries=0
        ) as stranger:
            with pytest.raises(AuthenticationError):
                await stranger.models.list()
        tally.add("sent", 2)
        assert (tally.failed, tally.hung) == (0, 0)
        await settle(router)


async def test_per_tenant_cap_uses_the_token_tenant(secrets) -> None:
    limits = {"max_concurrent_per_tenant": 1}
    async with (
        running(1, auth=secrets, limits=limits, tenant_header="X-Tenant") as (router, stubs),
        aiohttp.ClientSession() as http,
    ):
        stubs[0].behaviour.delay = 0.5
        tally = Tally.new()
        url = router.url + "/v1/chat/completions"
        acme = _auth(issue(KEY.encode(), "acme", 600))
        globex = _auth(issue(KEY.encode(), "globex", 600))
        first = asyncio.create_task(tally.send(http, url, **acme, **chat()))
        while not stubs[0].active:
            await asyncio.sleep(0.01)
        spoofed = {**acme["headers"], "X-Tenant": "globex"}  # the token's tenant wins
        refused = await tally.send(http, url, expect=429, headers=spoofed, **chat())
        assert (
            refused.headers["Retry-After"] == "1" and "acme" in refused.json()["error"]["message"]
        )
        await tally.send(http, url, **globex, **chat())  # another tenant is not capped
        await first
        assert (tally.failed, tally.hung) == (0, 0)
        await settle(router)


def _tenant_config(secrets: dict, auth: bool, trusted: bool) -> dict:
    """A router whose tenants come from `X-Tenant` as far as `auth` and `trusted` let."""
    trust = {"tenant_header_trusted": True} if trusted else {}  # untrusted by default
    return {"auth": {**secrets, **trust} if auth else {}, "tenant_header": "X-Tenant"}


def _as(token: str | None, tenant: str | None = None) -> dict[str, str]:
    """The headers of a request with `token` (if any) claiming `tenant` (if any)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return {**headers, "X-Tenant": tenant} if tenant else headers


@pytest.mark.parametrize(
    ("auth", "trusted", "victim_status"),
    [
        pytest.param(False, False, 429, id="auth-off-the-header-is-the-tenant"),
        pytest.param(True, False, 200, id="untrusted-header-ignored"),
        pytest.param(True, True, 429, id="trusted-header-is-the-tenant"),
    ],
)
async def test_a_claimed_tenant_fills_its_cap_only_where_the_header_is_trusted(
    secrets, auth: bool, trusted: bool, victim_status: int
) -> None:
    """A request that claims the victim's tenant by header (with a token that names no
    tenant, when auth is on) is held at the backend; the victim's own next request fits
    its cap of 1 unless the header is the tenant."""
    config = _tenant_config(secrets, auth, trusted)
    limits = {"max_concurrent_per_tenant": 1}
    async with (
        running(1, limits=limits, **config) as (router, stubs),
        aiohttp.ClientSession() as http,
    ):
        stubs[0].behaviour.hang_before_headers = True
        tally = Tally.new()
        url = router.url + CHAT_PATH
        spoofer = _as(ANONYMOUS if auth else None, "victim")
        held = asyncio.create_task(tally.send(http, url, expect=None, headers=spoofer, **chat()))
        await until(lambda: stubs[0].active == 1)
        stubs[0].behaviour.hang_before_headers = False
        victim = _as(issue(KEY.encode(), "victim", 600)) if auth else _as(None, "victim")
        await tally.send(http, url, expect=victim_status, headers=victim, **chat())
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await settle(router)
        assert (tally.failed, tally.hung) == (0, 0)


@pytest.mark.parametrize("trusted", [False, True], ids=["untrusted", "trusted"])
async def test_the_prefix_namespace_is_the_authenticated_tenants(secrets, trusted) -> None:
    """The tenant salts the fingerprint: a header claiming another tenant lands each prompt
    where that tenant's prompts land only when the header is trusted; else where a
    request without a tenant lands (no look into another tenant's cache)."""
    routing = {"strategy": "PREFIX_AWARE", "concurrency_threshold": None}
    config = _tenant_config(secrets, True, trusted)
    async with (
        running(4, routing, **config) as (router, _),
        aiohttp.ClientSession() as http,
    ):
        tally = Tally.new()
        url = router.url + CHAT_PATH

        async def backend(headers: dict[str, str], prompt: str) -> str:
            body = chat(messages=[{"role": "user", "content": prompt}])
            return (await tally.send(http, url, headers=headers, **body)).headers[
                "x-kvroute-backend"
            ]

        victim = _as(issue(KEY.encode(), "victim", 600))
        for i in range(8):
            prompt = f"the victim's document number {i}, " * 20
            claimed = await backend(_as(ANONYMOUS, "victim"), prompt)
            expected = victim if trusted else _as(ANONYMOUS)
            assert claimed == await backend(expected, prompt), prompt
        assert (tally.failed, tally.hung) == (0, 0)


async def test_tenant_labels_are_bounded_to_known_tenants(secrets) -> None:
    """Signed tokens can carry any tenant: only the static tokens' tenants and those
    `metrics.tenants` lists get a series of their own; the rest share `(other)`."""
    metrics = {"tenants": ["acme"]}
    async with (
        running(1, auth=secrets, metrics=metrics) as (router, _),
        aiohttp.ClientSession() as http,
    ):
        tally = Tally.new()
        url = router.url + CHAT_PATH
        tenants = ["acme", *(f"made-up-{i}" for i in range(20))]
        for tenant in tenants:
            await tally.send(http, url, **_auth(issue(KEY.encode(), tenant, 600)), **chat())
        await tally.send(http, url, **_auth(STATIC), **chat())
        page = (await tally.send(http, router.url + "/metrics", method="GET")).body.decode()
        counted = {
            s.labels["tenant"]: s.value
            for family in text_string_to_metric_families(page)
            for s in family.samples
            if s.name == "kvroute_tenant_requests_total"
        }
        assert counted == {"acme": 1.0, "team-a": 1.0, "(other)": 20.0}
        assert (tally.failed, tally.hung) == (0, 0)
