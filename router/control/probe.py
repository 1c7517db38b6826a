"""`kvroute health -c FILE`: GET /health on the listener the config names, over loopback.

The container image's HEALTHCHECK: a fixed `http://127.0.0.1:8000/health` fails a router
that serves TLS or listens on another port, so the check reads the same file as the
router. It asks `listen.port` with https when `listen.tls` is set, always on loopback: a
wildcard host (0.0.0.0, ::) is asked at 127.0.0.1 (::1), a loopback one as written. A
listener bound to another address is not reachable there, and the check says so rather
than ask it elsewhere. The certificate is not verified: it is this host's own listener,
whose certificate names the service, not 127.0.0.1.

Exit 0 for a 200; 1 otherwise, with the reason on one line (Docker reserves 2).
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import ssl
import sys

from router.config import ConfigError, ListenConfig, load

__all__ = ["loopback_host", "main"]

HEALTH_PATH = "/health"


def loopback_host(host: str) -> str:
    """The loopback address to ask a listener bound to `host` at; ValueError for a
    listener that loopback cannot reach."""
    if host in ("", "localhost"):
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"listen.host {host} is a name, not a loopback or wildcard address"
        ) from None
    if address.is_unspecified:
        return "::1" if address.version == 6 else "127.0.0.1"
    if address.is_loopback:
        return host
    raise ValueError(f"listen.host {host} is neither loopback nor a wildcard address")


def check(listen: ListenConfig, timeout: float) -> str | None:
    """GET /health on `listen` over loopback: None for a 200, else why not."""
    try:
        host = loopback_host(listen.host)
    except ValueError as exc:
        return f"{exc}: the check asks loopback only"
    scheme = "https" if listen.tls else "http"
    where = f"{scheme}://{'[' + host + ']' if ':' in host else host}:{listen.port}{HEALTH_PATH}"
    if listen.tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False  # loopback: the certificate names the service
        context.verify_mode = ssl.CERT_NONE
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, listen.port, timeout=timeout, context=context
        )
    else:
        conn = http.client.HTTPConnection(host, listen.port, timeout=timeout)
    try:
        conn.request("GET", HEALTH_PATH)
        status = conn.getresponse().status
    except (OSError, http.client.HTTPException) as exc:
        return f"{where}: {exc or type(exc).__name__}"
    finally:
        conn.close()
    return None if status == 200 else f"{where} answered {status}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvroute health",
        description="GET /health on the listener the config names (https with listen.tls), "
        "over loopback; exit 0 if it answers 200, else 1. The container image's HEALTHCHECK.",
    )
    parser.add_argument("-c", "--config", metavar="FILE", required=True, help="YAML config file")
    parser.add_argument("--timeout", type=float, default=2.0, metavar="S", help="default 2")
    args = parser.parse_args(argv)
    try:
        config = load(args.config)
    except ConfigError as exc:
        print(f"kvroute health: invalid config: {exc}", file=sys.stderr)
        return 1
    problem = check(config.listen, args.timeout)
    if problem is not None:
        print(f"kvroute health: {problem}", file=sys.stderr)
        return 1
    return 0
