"""`kvroute health -c FILE`, the image's HEALTHCHECK, against a real router process: it
asks /health where the config's listener is (its port, https with `listen.tls`), over
loopback, and says why when it cannot.

The router and the check are processes of their own: plain tests, on no event loop."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bench.harness.processes import free_port, process
from tests.pki import make_pki


def _config(tmp_path: Path, listen: dict) -> Path:
    path = tmp_path / "router.yaml"
    config = {"listen": listen, "backends": [{"url": "http://127.0.0.1:1"}], "workers": 1}
    path.write_text(yaml.safe_dump(config))
    return path


def _health(config: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "router", "health", "-c", str(config)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def _until_listening(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port}"
            time.sleep(0.05)


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_health_asks_the_configs_listener_and_says_when_it_is_gone(
    tmp_path: Path, tls: bool
) -> None:
    port = free_port()  # never the image's default 8000
    listen: dict = {"host": "127.0.0.1", "port": port}
    if tls:
        pki = make_pki(tmp_path / "pki")
        listen["tls"] = {"cert_file": str(pki / "server.pem"), "key_file": str(pki / "server.key")}
    config = _config(tmp_path, listen)
    cmd = [sys.executable, "-m", "router", "serve", "-c", str(config), "--log-level", "warning"]
    with process(cmd, subprocess.DEVNULL) as router:
        _until_listening(port)
        healthy = _health(config)
        router.terminate()
        assert router.wait(30) == 0
    assert (healthy.returncode, healthy.stderr) == (0, "")
    gone = _health(config)
    scheme = "https" if tls else "http"
    assert gone.returncode == 1
    assert gone.stderr.startswith(f"kvroute health: {scheme}://127.0.0.1:{port}/health: ")
    assert len(gone.stderr.splitlines()) == 1


def test_a_listener_loopback_cannot_reach_is_said_not_asked(tmp_path: Path) -> None:
    done = _health(_config(tmp_path, {"host": "192.0.2.10", "port": free_port()}))
    assert done.returncode == 1
    assert done.stderr == (
        "kvroute health: listen.host 192.0.2.10 is neither loopback nor a wildcard "
        "address: the check asks loopback only\n"
    )


def test_a_config_that_does_not_load_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("listen: {port: 8000}\n")  # no backend
    done = _health(path)
    assert done.returncode == 1
    assert done.stderr.startswith("kvroute health: invalid config: ")
    assert len(done.stderr.splitlines()) == 1
