"""TLS on the router's own listeners: HTTPS (the fast path and the aiohttp routes behind
it) and gRPC, with certificates from a test CA; a reload from the file serves a renewed
pair to new connections while open ones keep theirs, and a pair that does not load
leaves the old one serving."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx2
import openai
import orjson
import psutil
import pytest
import yaml

from bench.harness.processes import free_port
from proto.kvroute.v1 import kvroute_pb2 as pb
from proto.kvroute.v1 import kvroute_pb2_grpc as pb_grpc
from router.config import ConfigError
from router.control.reload import ConfigSource
from router.control.worker import Router
from tests.pki import make_pki
from tests.router.chaos import until
from tests.stub_backend import StubBackend

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
TIMEOUT = 10.0


@dataclass(frozen=True)
class Pki:
    a: Path  # the pair the router starts with, signed by CA A
    b: Path  # its renewal, signed by CA B


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    return Pki(make_pki(d / "a", "kvroute-test-CA-A"), make_pki(d / "b", "kvroute-test-CA-B"))


def _install(source: Path, live: Path) -> None:
    """Put `source`'s pair where the router's config names its own (as a renewal does)."""
    live.mkdir(exist_ok=True)
    shutil.copyfile(source / "server.pem", live / "server.pem")
    shutil.copyfile(source / "server.key", live / "server.key")


def _tls(d: Path) -> dict:
    return {"cert_file": str(d / "server.pem"), "key_file": str(d / "server.key")}


def _trusting(ca_dir: Path, alpn: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_dir / "ca.pem")
    if alpn is not None:
        context.set_alpn_protocols([alpn])
    return context


def _der(d: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert((d / "server.pem").read_text())


async def served_certificate(port: int, ca_dir: Path, alpn: str = "http/1.1") -> bytes:
    """The certificate a new connection to `port` is served, verified against `ca_dir`'s CA."""
    _, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=_trusting(ca_dir, alpn)), TIMEOUT
    )
    try:
        return writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:  # no TLS shutdown: gRPC's server answers no close_notify to a client that
        writer.transport.abort()  # never spoke HTTP/2, and it would wait for one


@dataclass
class Rig:
    router: Router
    stub: StubBackend
    path: Path  # the config file
    live: Path  # where it names the certificate and key
    base: dict

    def rewrite(self, **changes) -> None:
        self.path.write_text(yaml.safe_dump({**self.base, **changes}))

    def openai(self, ca_dir: Path) -> openai.AsyncOpenAI:
        http = httpx2.AsyncClient(verify=_trusting(ca_dir), timeout=TIMEOUT)
        return openai.AsyncOpenAI(
            base_url=self.router.url + "/v1", api_key="unused", http_client=http, max_retries=0
        )

    def channel(self, ca_dir: Path) -> grpc.aio.Channel:
        credentials = grpc.ssl_channel_credentials((ca_dir / "ca.pem").read_bytes())
        return grpc.aio.secure_channel(f"127.0.0.1:{self.router.grpc_port}", credentials)


@asynccontextmanager
async def tls_router(tmp_path: Path, pki: Pki, **grpc_fields) -> AsyncIterator[Rig]:
    """A router reading its config from a file, HTTPS and gRPC with CA A's pair."""
    live = tmp_path / "live"
    _install(pki.a, live)
    stub = await StubBackend().start()
    base = {
        "listen": {"host": "127.0.0.1", "port": 0, "tls": _tls(live)},
        "grpc": {"enabled": True, "port": 0, **grpc_fields},
        "backends": [{"url": stub.url, "name": "b0"}],
        "routing": {"strategy": "RANDOM"},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(base))
    source = ConfigSource(str(path))
    router = Router(source.load(), source)
    await router.start()
    try:
        yield Rig(router, stub, path, live, base)
    finally:
        await router.stop()
        await stub.stop()


async def _grpc_chat(channel: grpc.aio.Channel) -> str:
    api = pb_grpc.InferenceStub(channel)
    request = pb.ChatCompletionRequest(
        model="stub-model", messages=[pb.ChatMessage(role="user", content="hi")]
    )
    answer = await api.CreateChatCompletion(request, timeout=TIMEOUT)
    chunks = [c async for c in api.StreamChatCompletion(request, timeout=TIMEOUT)]
    assert chunks
    return answer.choices[0].message.content


async def test_the_openai_sdk_chats_and_streams_over_https(tmp_path, pki) -> None:
    async with tls_router(tmp_path, pki) as rig:
        assert rig.router.url.startswith("https://")
        client = rig.openai(pki.a)
        try:
            answer = await client.chat.completions.create(**CHAT)
            stream = await client.chat.completions.create(**CHAT, stream=True)
            chunks = [chunk async for chunk in stream]
            models = await client.models.list()  # aiohttp's route, behind the fast path
            health = await client._client.get(rig.router.url + "/health")
        finally:
            await client.close()
        assert answer.choices[0].message.content and chunks
        assert [m.id for m in models.data] == ["stub-model"] and health.status_code == 200
        assert len(rig.stub.received) == 2


async def test_a_client_offering_h2_is_answered_http_1_1(tmp_path, pki) -> None:
    async with tls_router(tmp_path, pki) as rig:
        context = _trusting(pki.a)
        context.set_alpn_protocols(["h2", "http/1.1"])
        conn = await asyncio.open_connection("127.0.0.1", rig.router.port, ssl=context)
        assert conn[1].get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
        assert await _health(*conn) == 200
        conn[1].close()


async def _plain(port: int, request: bytes) -> bytes:
    """What `request`, sent as plain HTTP over a raw socket to `port`, gets back, up to
    the router's close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await asyncio.wait_for(reader.read(), TIMEOUT)
    finally:
        writer.close()


async def test_plain_http_to_the_tls_port_is_answered_400_and_tls_serves_on(
    tmp_path, pki, caplog
) -> None:
    """As nginx does: a 400 whose body says why, not an empty reply; TLS clients are
    served before and after on the same port."""
    get = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    body = orjson.dumps(CHAT)
    post = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n%s"
    async with tls_router(tmp_path, pki) as rig:
        with caplog.at_level(logging.DEBUG):
            before = await served_certificate(rig.router.port, pki.a)
            replies = [
                await _plain(rig.router.port, get),
                await _plain(rig.router.port, post % (len(body), body)),
            ]
            client = rig.openai(pki.a)
            try:
                answer = await client.chat.completions.create(**CHAT)
            finally:
                await client.close()
    assert before == _der(pki.a)
    for reply in replies:
        head, _, content = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n"), reply
        assert b"\r\nConnection: close" in head
        assert orjson.loads(content)["error"] == {
            "message": "The plain HTTP request was sent to the HTTPS port: use https:// for it.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    assert answer.choices[0].message.content
    assert len(rig.stub.received) == 1  # no plain request reached a backend
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_grpc_over_tls_and_plaintext_is_refused(tmp_path, pki) -> None:
    async with tls_router(tmp_path, pki) as rig:
        async with rig.channel(pki.a) as channel:
            assert await _grpc_chat(channel)
        target = f"127.0.0.1:{rig.router.grpc_port}"
        async with grpc.aio.insecure_channel(target) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _grpc_chat(plain)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_grpc_tls_of_its_own_overrides_the_listeners(tmp_path, pki) -> None:
    async with tls_router(tmp_path, pki, tls=_tls(pki.b)) as rig:
        assert await served_certificate(rig.router.port, pki.a) == _der(pki.a)
        assert await served_certificate(rig.router.grpc_port, pki.b, "h2") == _der(pki.b)
        async with rig.channel(pki.b) as channel:
            assert await _grpc_chat(channel)


async def test_a_reload_serves_the_new_pair_to_new_connections(tmp_path, pki) -> None:
    async with tls_router(tmp_path, pki) as rig:
        kept = await asyncio.open_connection("127.0.0.1", rig.router.port, ssl=_trusting(pki.a))
        assert await _health(*kept) == 200
        _install(pki.b, rig.live)
        report = await rig.router.reloader.reload()
        assert report["at_restart"] == []
        assert await served_certificate(rig.router.port, pki.b) == _der(pki.b)
        assert await served_certificate(rig.router.grpc_port, pki.b, "h2") == _der(pki.b)
        renewed = rig.openai(pki.b)
        stale = rig.openai(pki.a)
        try:
            assert (await renewed.chat.completions.create(**CHAT)).choices
            with pytest.raises(openai.APIConnectionError):  # CA A signed no longer
                await stale.chat.completions.create(**CHAT)
        finally:
            await renewed.close()
            await stale.close()
        async with rig.channel(pki.b) as channel:
            assert await _grpc_chat(channel)
        # the connection open before the reload still serves, with the old certificate
        assert await _health(*kept) == 200
        assert kept[1].get_extra_info("ssl_object").getpeercert(True) == _der(pki.a)
        kept[1].close()


async def _health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    """GET /health on an open keep-alive connection; its status."""
    writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
    lines = head.decode().split("\r\n")
    length = next(int(v) for k, _, v in (h.partition(": ") for h in lines) if k == "Content-Length")
    await asyncio.wait_for(reader.readexactly(length), TIMEOUT)
    return int(lines[0].split()[1])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        pytest.param("other_key", "is not the key of cert_file", id="a key of another cert"),
        pytest.param("garbage_cert", "holds no PEM certificate", id="no certificate"),
        pytest.param("garbage_key", "holds no unencrypted PEM private key", id="no key"),
        pytest.param("no_key", "cannot read", id="key missing"),
    ],
)
async def test_a_pair_that_does_not_load_on_reload_keeps_the_old_one(
    tmp_path, pki, caplog, damage: str, message: str
) -> None:
    async with tls_router(tmp_path, pki) as rig:
        cert, key = rig.live / "server.pem", rig.live / "server.key"
        if damage == "other_key":
            shutil.copyfile(pki.b / "server.pem", cert)
        elif damage == "garbage_cert":
            cert.write_text("not a certificate\n")
        elif damage == "garbage_key":
            key.write_text("not a key\n")
        else:
            key.unlink()
        with caplog.at_level(logging.ERROR, logger="kvroute.config"):
            with pytest.raises(ConfigError, match=message):
                await rig.router.reloader.reload()
        (line,) = [r.getMessage() for r in caplog.records if "reload rejected" in r.getMessage()]
        assert "listen.tls: " in line and message in line
        assert await served_certificate(rig.router.port, pki.a) == _der(pki.a)
        assert await served_certificate(rig.router.grpc_port, pki.a, "h2") == _der(pki.a)
        async with rig.channel(pki.a) as channel:
            assert await _grpc_chat(channel)


async def test_turning_tls_off_waits_for_a_restart(tmp_path, pki) -> None:
    async with tls_router(tmp_path, pki) as rig:
        rig.rewrite(listen={"host": "127.0.0.1", "port": 0})
        report = await rig.router.reloader.reload()
        assert "listen.tls and grpc.tls (TLS on or off)" in report["at_restart"]
        assert rig.router.config.listen.tls is not None  # the running choice is kept
        assert await served_certificate(rig.router.port, pki.a) == _der(pki.a)


async def test_sighup_renews_the_pair_in_every_worker(tmp_path, pki) -> None:
    """`kvroute serve --workers 2`: the supervisor forwards SIGHUP, each worker reads the
    new pair; new connections accepted by either worker are served it."""
    live = tmp_path / "live"
    _install(pki.a, live)
    stub = await StubBackend().start()
    port = free_port()
    path = tmp_path / "router.yaml"
    config = {"listen": {"host": "127.0.0.1", "port": port, "tls": _tls(live)}}
    path.write_text(yaml.safe_dump({**config, "backends": [{"url": stub.url}], "workers": 2}))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "serve", "-c", str(path), stderr=asyncio.subprocess.PIPE
    )
    log = bytearray()

    async def read_log() -> None:
        async for line in proc.stderr:
            log.extend(line)

    reader = asyncio.create_task(read_log())
    try:
        await until(lambda: log.count(b"kvroute listening on https://") == 2, 30)
        assert await served_certificate(port, pki.a) == _der(pki.a)
        _install(pki.b, live)
        proc.send_signal(signal.SIGHUP)
        await until(lambda: log.count(b"config reloaded") == 3, 10)  # 2 workers, collector
        owners = await _owners_of_new_connections(proc.pid, port, pki.b)
        assert len(owners) == 2, log.decode()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        await reader
        await stub.stop()


async def _owners_of_new_connections(supervisor: int, port: int, ca_dir: Path) -> set[int]:
    """Open TLS connections to `port`, each checked to be served `ca_dir`'s pair, until
    both workers have accepted one (bounded); the pids that did."""
    owners: set[int] = set()
    held = []
    try:
        for _ in range(64):
            _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=_trusting(ca_dir))
            held.append(writer)
            assert writer.get_extra_info("ssl_object").getpeercert(True) == _der(ca_dir)
            owners.add(_owner(supervisor, port, writer.get_extra_info("sockname")[1]))
            if len(owners) == 2:
                break
    finally:
        for writer in held:
            writer.close()
    return owners


def _owner(supervisor: int, port: int, client_port: int) -> int | None:
    """The worker holding the server end of the connection from `client_port`."""
    for child in psutil.Process(supervisor).children():
        for c in child.net_connections(kind="tcp"):
            if c.raddr and c.raddr.port == client_port and c.laddr.port == port:
                return child.pid
    return None
