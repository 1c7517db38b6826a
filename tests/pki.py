"""Test certificates made with openssl's command line: a CA and a server certificate it
signed for 127.0.0.1, in a directory of their own (tests skip where openssl is missing)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d: Path, ca_name: str = "kvroute-test-CA") -> Path:
    """In `d`: ca.pem (and ca.key), and server.pem and server.key, signed by that CA for
    IP 127.0.0.1; returns `d`."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d.mkdir(parents=True, exist_ok=True)
    ca = "req -x509 -newkey rsa:2048 -nodes -days 2 -keyout ca.key -out ca.pem"
    _openssl(*ca.split(), "-subj", f"/CN={ca_name}", cwd=d)
    csr = "req -newkey rsa:2048 -nodes -keyout server.key -out server.csr"
    _openssl(*csr.split(), "-subj", "/CN=127.0.0.1", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    sign = "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2"
    _openssl(*sign.split(), "-extfile", "san.ext", "-out", "server.pem", cwd=d)
    return d
