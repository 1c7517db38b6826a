"""router/control/tls.py: a pair that does not load is a ConfigError naming the file,
before anything listens (`Router(...)` loads it, and `kvroute serve --check` builds one).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from router.config import ConfigError, build
from router.control.tls import ServingTls
from tests.pki import make_pki

BACKENDS = [{"url": "http://127.0.0.1:9"}]


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """Two pairs, a/ and b/ (by two CAs); a's key also encrypted, as a/enc.key."""
    d = tmp_path_factory.mktemp("pki")
    make_pki(d / "a", "kvroute-test-CA-A")
    make_pki(d / "b", "kvroute-test-CA-B")
    encrypt = ["pkey", "-in", "server.key", "-aes256", "-passout", "pass:x", "-out", "enc.key"]
    subprocess.run(["openssl", *encrypt], cwd=d / "a", check=True, capture_output=True, timeout=60)
    return d


def _tls(pki: Path, cert: str, key: str) -> dict:
    return {"cert_file": str(pki / cert), "key_file": str(pki / key)}


# (id, listen.tls's cert and key, grpc.tls's or None, what the error says)
CASES = [
    ("cert missing", ("a/none.pem", "a/server.key"), None,
     r"^listen.tls: cannot read .*a/none.pem: No such file or directory$"),
    ("key missing", ("a/server.pem", "a/none.key"), None,
     r"^listen.tls: cannot read .*a/none.key: No such file or directory$"),
    ("another cert's key", ("a/server.pem", "b/server.key"), None,
     r"^listen.tls: key_file .*b/server.key is not the key of cert_file .*a/server.pem$"),
    ("no certificate", ("a/san.ext", "a/server.key"), None,
     r"^listen.tls: cert_file .*a/san.ext holds no PEM certificate$"),
    ("no key", ("a/server.pem", "a/server.pem"), None,
     r"^listen.tls: key_file .*a/server.pem holds no unencrypted PEM private key$"),
    ("encrypted key", ("a/server.pem", "a/enc.key"), None,
     r"^listen.tls: key_file .*a/enc.key holds no unencrypted PEM private key$"),
    ("gRPC's own pair", ("a/server.pem", "a/server.key"), ("b/server.pem", "a/server.key"),
     r"^grpc.tls: key_file .*a/server.key is not the key of cert_file .*b/server.pem$"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("listen", "grpc", "message"), [pytest.param(*c[1:], id=c[0]) for c in CASES]
)
def test_a_pair_that_does_not_load_is_a_config_error_naming_the_file(
    pki: Path, listen: tuple[str, str], grpc: tuple[str, str] | None, message: str
) -> None:
    data = {"listen": {"tls": _tls(pki, *listen)}, "backends": BACKENDS}
    if grpc is not None:
        data["grpc"] = {"enabled": True, "tls": _tls(pki, *grpc)}
    with pytest.raises(ConfigError, match=message):
        ServingTls.load(build(data))


# (id, the config's listen.tls, grpc section, whether HTTP and gRPC serve TLS)
SERVING = [
    ("plain", None, {"enabled": True}, (False, False)),
    ("gRPC takes the listener's pair", ("a/server.pem", "a/server.key"), {"enabled": True},
     (True, True)),
    ("gRPC off", ("a/server.pem", "a/server.key"), {"enabled": False}, (True, False)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("listen", "grpc", "serving"), [pytest.param(*c[1:], id=c[0]) for c in SERVING]
)
def test_which_listeners_serve_tls(
    pki: Path, listen: tuple[str, str] | None, grpc: dict, serving: tuple[bool, bool]
) -> None:
    tls = None if listen is None else _tls(pki, *listen)
    loaded = ServingTls.load(build({"listen": {"tls": tls}, "grpc": grpc, "backends": BACKENDS}))
    assert (loaded.http is not None, loaded.grpc is not None) == serving
