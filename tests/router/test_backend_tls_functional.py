"""https backends: their certificate is always verified, against a CA bundle
(`ca_file`, per backend or in `backend_defaults`) or the system's; one signed by no
trusted CA is refused, and the logs say why."""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import openai
import pytest

from router.config import ConfigError, build
from router.control.worker import Router
from tests.pki import make_pki
from tests.stub_backend import StubBackend

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A test CA and a certificate it signed for 127.0.0.1."""
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _https_stub(pki: Path) -> StubBackend:
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(pki / "server.pem", pki / "server.key")
    return await StubBackend(tls=tls).start()


def _config(stub: StubBackend, **backend) -> dict:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"url": stub.url, "name": "b0", **backend}],
        "routing": {"strategy": "RANDOM"},
    }


async def test_an_https_backend_signed_by_the_configured_ca_serves(pki: Path) -> None:
    stub = await _https_stub(pki)
    stub.behaviour.metrics = 'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
    config = _config(stub)
    config["backend_defaults"] = {"ca_file": str(pki / "ca.pem")}
    config["telemetry"] = {"scrape_interval": 0.05}
    router = Router(build(config))
    await router.start()
    try:
        assert router.fleet.members[0].healthy  # the health check went over TLS too
        assert router.fleet.members[0].discovered_models == {"stub-model"}  # and the poll
        async with asyncio.timeout(10):  # and the scrapes
            while (router.telemetry.describe("b0") or {}).get("running") != 1.0:
                await asyncio.sleep(0.02)
        async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused") as client:
            answer = await client.chat.completions.create(**CHAT)
            stream = await client.chat.completions.create(**CHAT, stream=True)
            chunks = [chunk async for chunk in stream]
    finally:
        await router.stop()
        await stub.stop()
    assert answer.choices[0].message.content and chunks
    assert len(stub.received) == 2


async def test_an_untrusted_certificate_is_refused_and_the_log_says_why(pki, caplog) -> None:
    stub = await _https_stub(pki)
    router = Router(build(_config(stub)))  # the system's CAs never signed the test CA
    try:
        with caplog.at_level(logging.WARNING, logger="kvroute.backends"):
            await router.start()
        async with openai.AsyncOpenAI(
            base_url=router.url + "/v1", api_key="unused", max_retries=0
        ) as client:
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(**CHAT)
    finally:
        await router.stop()
        await stub.stop()
    assert refused.value.status_code == 503  # no usable backend: it failed its checks
    assert stub.received == []
    (warning,) = [r.getMessage() for r in caplog.records if "at start" in r.getMessage()]
    assert "b0 (GET /health: its TLS certificate is not trusted (" in warning


def test_a_ca_file_that_cannot_be_read_is_a_config_error(tmp_path) -> None:
    config = build({"backends": [{"url": "https://127.0.0.1:9", "ca_file": str(tmp_path / "x")}]})
    with pytest.raises(ConfigError, match="ca_file"):
        Router(config)
