"""Where `kvroute health` asks a listener: loopback only (router/control/probe.py)."""

from __future__ import annotations

import pytest

from router.control.probe import loopback_host


@pytest.mark.parametrize(
    "host,asked",
    [
        ("0.0.0.0", "127.0.0.1"),
        ("::", "::1"),
        ("", "127.0.0.1"),
        ("localhost", "127.0.0.1"),
        ("127.0.0.1", "127.0.0.1"),
        ("127.0.0.2", "127.0.0.2"),
        ("::1", "::1"),
    ],
)
def test_a_wildcard_or_loopback_listener_is_asked_on_loopback(host: str, asked: str) -> None:
    assert loopback_host(host) == asked


@pytest.mark.parametrize("host", ["10.0.0.5", "2001:db8::1", "router.internal"])
def test_any_other_listener_is_not_asked(host: str) -> None:
    with pytest.raises(ValueError, match=f"listen.host {host} is"):
        loopback_host(host)
