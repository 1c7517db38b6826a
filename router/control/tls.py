"""The listeners' certificates: read at start, renewed by a reload, served to new
connections while the ports stay open.

Which pair a listener serves: HTTP `listen.tls`; gRPC `grpc.tls`, else `listen.tls`
(TLS on one means TLS on both, unless gRPC names a pair of its own). One pair named by
both is read once.

HTTP (TLS 1.2+, ALPN http/1.1 only: the router speaks no h2): the listening socket
keeps the context it was given; its `sni_callback`, which OpenSSL calls in every
ClientHello (with or without SNI), moves the new connection to the newest context. A
renewal builds a whole new context and swaps that one reference (build, validate, swap:
STYLE.md §6). Loading the new pair into the live context instead is not safe: a key that
does not match drops the context's certificate half-way and every later handshake fails.
gRPC: `dynamic_ssl_server_credentials`, whose fetcher gRPC calls at each new handshake;
it hands over a renewed pair once, then answers None (no change).

A pair that does not load (a file unreadable, no PEM certificate, no unencrypted PEM
key, a key of another certificate) is a ConfigError naming the file: at start, and on
reload, where nothing changes and the old pair keeps serving. Connections already open
keep the certificate they began with.

Cost: nothing per request; per new connection one Python call (HTTP's callback, gRPC's
fetcher under a lock).
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from router.config import Config, ConfigError, ListenerTls

__all__ = ["GrpcCertificates", "HttpsCertificates", "ServingTls", "serving_tls"]


def serving_tls(config: Config) -> tuple[ListenerTls | None, ListenerTls | None]:
    """The pairs HTTP and gRPC serve under `config` (None: plain, or gRPC off)."""
    grpc_tls = (config.grpc.tls or config.listen.tls) if config.grpc.enabled else None
    return config.listen.tls, grpc_tls


@dataclass(frozen=True)
class _Pair:
    """A certificate chain and its key, as read, and a server context serving them."""

    chain: bytes
    key: bytes
    context: ssl.SSLContext


def _load(tls: ListenerTls, where: str) -> _Pair:
    """Read and check the pair; ConfigError naming the file that is wrong."""
    chain, key = _read(tls.cert_file, where), _read(tls.key_file, where)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file, password=_no_password)
    except ssl.SSLError as exc:
        raise ConfigError(f"{where}: {_culprit(tls, exc)}") from None
    except OSError as exc:  # gone since it was read
        raise ConfigError(f"{where}: cannot read {tls.cert_file}: {exc.strerror}") from None
    if (_read(tls.cert_file, where), _read(tls.key_file, where)) != (chain, key):
        # gRPC serves the bytes, HTTP what OpenSSL read: they must be the same pair
        raise ConfigError(f"{where}: {tls.cert_file} or {tls.key_file} changed while read")
    return _Pair(chain, key, context)


def _read(path: str, where: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc.strerror}") from None


def _no_password() -> bytes:
    """An encrypted key fails to load, rather than OpenSSL asking on the terminal."""
    return b""


def _culprit(tls: ListenerTls, exc: ssl.SSLError) -> str:
    """Which file of the pair is wrong, and how (OpenSSL's error names neither)."""
    if exc.reason == "KEY_VALUES_MISMATCH":
        return f"key_file {tls.key_file} is not the key of cert_file {tls.cert_file}"
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=tls.cert_file)
    except OSError:  # ssl.SSLError among them
        return f"cert_file {tls.cert_file} holds no PEM certificate"
    return f"key_file {tls.key_file} holds no unencrypted PEM private key"


class HttpsCertificates:
    """The HTTP listener's context; a renewal moves new handshakes to a new one."""

    def __init__(self, first: _Pair) -> None:
        #: what the listening socket holds for good
        self.context = first.context
        self._current = first.context
        self.context.sni_callback = self._choose

    def renew(self, pair: _Pair) -> None:
        self._current = pair.context

    def _choose(self, conn: ssl.SSLObject, server_name: str | None, front: ssl.SSLContext) -> None:
        """OpenSSL's servername callback, before the certificate is chosen; returning
        None lets the handshake go on."""
        if self._current is not front:
            conn.context = self._current


class GrpcCertificates:
    """gRPC's server credentials; a renewal is handed to the next handshake."""

    def __init__(self, first: _Pair) -> None:
        self._lock = threading.Lock()  # gRPC calls the fetcher from its own threads
        self._renewed: grpc.ServerCertificateConfiguration | None = None
        self.credentials = grpc.dynamic_ssl_server_credentials(_grpc_config(first), self._fetch)

    def renew(self, pair: _Pair) -> None:
        with self._lock:
            self._renewed = _grpc_config(pair)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            renewed, self._renewed = self._renewed, None
        return renewed


def _grpc_config(pair: _Pair) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(pair.key, pair.chain)])


@dataclass
class ServingTls:
    """The certificates of a process's listeners: HTTP's, gRPC's, either or both None
    (plain, gRPC off, or a process with no listener, as the collector)."""

    http: HttpsCertificates | None = None
    grpc: GrpcCertificates | None = None

    @classmethod
    def load(cls, config: Config) -> ServingTls:
        """The pairs `config` names, read and checked; ConfigError if one fails."""
        http, rpc = _load_pairs(config)
        return cls(
            None if http is None else HttpsCertificates(http),
            None if rpc is None else GrpcCertificates(rpc),
        )

    def renewal(self, config: Config) -> Callable[[], None]:
        """Build and validate: read again the pairs `config` names (ConfigError if one
        fails, and nothing changed); the returned swap serves them to new connections
        and never fails. A listener serves TLS or not until a restart: `config` must
        not turn it on or off (router/control/reload.py keeps the running choice)."""
        if self.http is None and self.grpc is None:
            return _unchanged
        http, rpc = _load_pairs(config)

        def swap() -> None:
            if self.http is not None and http is not None:
                self.http.renew(http)
            if self.grpc is not None and rpc is not None:
                self.grpc.renew(rpc)

        return swap


def _unchanged() -> None:
    """No listener of this process serves TLS."""


def _load_pairs(config: Config) -> tuple[_Pair | None, _Pair | None]:
    """HTTP's pair and gRPC's, read once when both name the same files."""
    http_tls, grpc_tls = serving_tls(config)
    http = None if http_tls is None else _load(http_tls, "listen.tls")
    if grpc_tls is None:
        return http, None
    if grpc_tls == http_tls:
        return http, http
    return http, _load(grpc_tls, "grpc.tls")
