"""How the router reaches a backend. One that needs an API key (vLLM's --api-key): the
key, named by `api_key_env` or `api_key_file` and never written in the YAML, reaches it
as a Bearer token and nowhere else: not the logs, not /admin/config, not /debug/routing.
One behind a path prefix gets every call under it."""

from __future__ import annotations

import logging

import aiohttp
import openai
import pytest

from router.config import ConfigError, build
from router.control.worker import Router
from tests.stub_backend import Behaviour, StubBackend

KEY = "sk-backend-7f3a9c"
DATA_TOKEN = "client-token-1"
ADMIN_TOKEN = "admin-token-1"


def _config(backend: StubBackend, **credentials) -> dict:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": backend.url, "name": "b0", **credentials}],
        "auth": {"enabled": True, "tokens_env": "KV_CRED_TOKENS"},
        "admin": {"port": 0, "token_env": "KV_CRED_ADMIN"},
        "routing": {"strategy": "RANDOM"},
    }


@pytest.fixture
def secrets(monkeypatch) -> None:
    monkeypatch.setenv("KV_CRED_KEY", KEY)
    monkeypatch.setenv("KV_CRED_TOKENS", DATA_TOKEN)
    monkeypatch.setenv("KV_CRED_ADMIN", ADMIN_TOKEN)


async def test_the_key_reaches_the_backend_as_bearer_and_shows_nowhere(secrets, caplog) -> None:
    stub = await StubBackend(behaviour=Behaviour(api_key=KEY)).start()
    headers = {"X-Team": "search"}
    router = Router(build(_config(stub, api_key_env="KV_CRED_KEY", headers=headers)))
    try:
        with caplog.at_level(logging.DEBUG):
            await router.start()
            async with openai.AsyncOpenAI(
                base_url=router.url + "/v1", api_key=DATA_TOKEN
            ) as client:
                answer = await client.chat.completions.create(
                    model="stub-model", messages=[{"role": "user", "content": "hi"}]
                )
                models = await client.models.list()  # the router's list, from its polls
            async with aiohttp.ClientSession() as http:
                admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
                pages = []
                for url in (
                    router.admin.url + "/admin/config",
                    router.admin.url + "/admin/backends",
                    router.url + "/debug/routing",
                    router.url + "/metrics",
                ):
                    async with http.get(url, headers=admin) as resp:
                        assert resp.status == 200, url
                        pages.append(await resp.text())
    finally:
        await router.stop()
        await stub.stop()
    assert answer.choices[0].message.content
    assert [m.id for m in models.data] == ["stub-model"]
    (sent,) = stub.headers
    assert sent["Authorization"] == f"Bearer {KEY}"  # not the client's token
    assert sent["X-Team"] == "search"
    assert "KV_CRED_KEY" in pages[0]  # the config names where the key is read from
    for page in pages:
        assert KEY not in page
    assert all(KEY not in record.getMessage() for record in caplog.records)


async def test_fleet_defaults_apply_and_a_backends_own_key_wins(secrets, monkeypatch) -> None:
    monkeypatch.setenv("KV_CRED_OTHER", "sk-own")
    defaulted = await StubBackend(behaviour=Behaviour(api_key=KEY)).start()
    own = await StubBackend(behaviour=Behaviour(api_key="sk-own")).start()
    config = _config(defaulted)
    config["backends"] += [{"url": own.url, "name": "b1", "api_key_env": "KV_CRED_OTHER"}]
    config["backend_defaults"] = {"api_key_env": "KV_CRED_KEY", "headers": {"X-Fleet": "1"}}
    router = Router(build(config))
    await router.start()
    try:
        async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key=DATA_TOKEN) as client:
            for _ in range(12):  # RANDOM: both backends answer some
                await client.chat.completions.create(
                    model="stub-model", messages=[{"role": "user", "content": "hi"}]
                )
    finally:
        await router.stop()
        await defaulted.stop()
        await own.stop()
    assert defaulted.headers and own.headers  # every request answered 200 by one of them
    assert {h["Authorization"] for h in defaulted.headers} == {f"Bearer {KEY}"}
    assert {h["Authorization"] for h in own.headers} == {"Bearer sk-own"}
    assert {h["X-Fleet"] for h in [*defaulted.headers, *own.headers]} == {"1"}


async def test_a_reload_reads_a_rotated_key_file(secrets, tmp_path) -> None:
    key_file = tmp_path / "backend.key"
    key_file.write_text("sk-first\n")
    stub = await StubBackend().start()
    router = Router(build(_config(stub, api_key_file=str(key_file))))
    await router.start()
    try:
        async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key=DATA_TOKEN) as client:
            chat = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
            await client.chat.completions.create(**chat)
            key_file.write_text("sk-second\n")
            await router.reloader.apply(build(_config(stub, api_key_file=str(key_file))))
            await client.chat.completions.create(**chat)
    finally:
        await router.stop()
        await stub.stop()
    assert [h["Authorization"] for h in stub.headers] == ["Bearer sk-first", "Bearer sk-second"]


def test_a_key_that_cannot_be_read_is_a_config_error_naming_its_source(tmp_path) -> None:
    stub_url = "http://127.0.0.1:9"
    config = build({"backends": [{"url": stub_url, "name": "b0", "api_key_env": "KV_CRED_UNSET"}]})
    with pytest.raises(
        ConfigError, match="backend b0: api key: environment variable KV_CRED_UNSET"
    ):
        Router(config)
    missing = tmp_path / "absent.key"
    config = build({"backends": [{"url": stub_url, "api_key_file": str(missing)}]})
    with pytest.raises(ConfigError, match="cannot read"):
        Router(config)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"api_key_env": "A", "api_key_file": "/k"}, "not both"),
        ({"headers": {"Authorization": "Bearer x"}}, "the router's own"),
        ({"headers": {"Bad Name": "x"}}, "not a valid HTTP token"),
        ({"headers": {"X-Ok": "a\r\nInjected: 1"}}, "CR, LF or NUL"),
    ],
)
def test_bad_credentials_are_refused_at_load(entry: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build({"backends": [{"url": "http://127.0.0.1:9", **entry}]})


async def test_a_backend_behind_a_path_prefix_gets_every_call_under_it() -> None:
    """http://host:port/team/vllm: requests, health checks and model polls all go to
    /team/vllm/...; the stub answers 404 anywhere else."""
    stub = await StubBackend(prefix="/team/vllm").start()
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": stub.url + "/"}],
        "routing": {"strategy": "RANDOM"},
    }
    router = Router(build(config))
    await router.start()
    try:
        (backend,) = router.fleet.members
        assert backend.healthy and backend.models == frozenset({"stub-model"})
        assert backend.name == f"127.0.0.1:{stub.port}/team/vllm"
        async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused") as client:
            answer = await client.chat.completions.create(
                model="stub-model", messages=[{"role": "user", "content": "hi"}]
            )
    finally:
        await router.stop()
        await stub.stop()
    assert answer.choices[0].message.content
    assert stub.health_checks >= 1 and len(stub.received) == 1


async def test_a_wrong_backend_key_is_a_warning_and_a_502_not_the_routers_401(
    secrets, monkeypatch, caplog
) -> None:
    """The backend refuses the key the router sends: the model polls and health checks
    warn once (not each round), and a client with a good token gets a 502 naming the
    backend and what it refused, not a 401 it would take for its own token's."""
    monkeypatch.setenv("KV_CRED_WRONG", "sk-wrong")
    stub = await StubBackend(behaviour=Behaviour(api_key=KEY)).start()
    config = _config(stub, api_key_env="KV_CRED_WRONG")
    config["health"] = {"path": "/v1/models"}  # a gateway that guards /health too
    router = Router(build(config))
    try:
        with caplog.at_level(logging.INFO, logger="kvroute.backends"):
            await router.start()
            await router.poller.poll_once()  # a second round: no second warning
            await router.health.check_once()
            async with openai.AsyncOpenAI(
                base_url=router.url + "/v1", api_key=DATA_TOKEN, max_retries=0
            ) as client:
                with pytest.raises(openai.APIStatusError) as info:
                    await client.chat.completions.create(
                        model="stub-model", messages=[{"role": "user", "content": "hi"}]
                    )
    finally:
        await router.stop()
        await stub.stop()
    refusals = [
        r.getMessage() for r in caplog.records if "refuses the router's credentials" in r.message
    ]
    assert (
        sorted(refusals)
        == [
            "backend b0 refuses the router's credentials: GET /v1/models answered 401 (check its "
            "api_key)"
        ]
        * 2
    )  # one from the model polls, one from the health checks
    error = info.value
    assert error.status_code == 502
    assert error.response.headers["x-kvroute-backend"] == "b0"
    assert error.body["type"] == "BadGatewayError"
    assert f"Backend b0 (127.0.0.1:{stub.port}) refused the router's credentials" in error.message
    assert "sk-wrong" not in error.message


async def test_a_request_a_backend_refuses_so_is_served_by_another(secrets, monkeypatch) -> None:
    monkeypatch.setenv("KV_CRED_WRONG", "sk-wrong")
    refusing = await StubBackend(behaviour=Behaviour(api_key=KEY)).start()
    other = await StubBackend().start()
    config = _config(refusing, api_key_env="KV_CRED_WRONG")
    config["backends"].append({"url": other.url, "name": "b1"})
    router = Router(build(config))
    await router.start()
    chat = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
    refused = b'kvroute_upstream_errors_total{backend="b0",kind="credentials"} 1.0'
    served = []
    try:
        url = router.url + "/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key=DATA_TOKEN, max_retries=0) as oai:
            for _ in range(40):  # RANDOM: bounded, until one was tried on b0 first
                raw = await oai.chat.completions.with_raw_response.create(**chat)
                served.append(raw.headers["x-kvroute-backend"])
                if refused in router.metrics.render():
                    break
            else:
                raise AssertionError("no request was tried on b0 first")
    finally:
        await router.stop()
        await refusing.stop()
        await other.stop()
    assert set(served) == {"b1"} and not refusing.received


async def test_a_backend_401_to_the_clients_own_token_passes_through() -> None:
    """With the router's auth off and no key of its own for the backend, the client's
    token is what the backend judges: its 401 is the client's answer."""
    stub = await StubBackend(behaviour=Behaviour(api_key=KEY)).start()
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": stub.url, "name": "b0"}],
    }
    router = Router(build(config))
    await router.start()
    chat = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
    url = router.url + "/v1"
    try:
        async with openai.AsyncOpenAI(base_url=url, api_key="sk-bad", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(**chat)
        async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0) as good:
            answer = await good.chat.completions.create(**chat)
    finally:
        await router.stop()
        await stub.stop()
    assert answer.choices[0].message.content
