"""The Rust routers from PyPI that the benchmarks compare kvroute with (sglang-router,
vllm-router): their own virtualenv, pip-installed on first use so that the project's
dependencies stay untouched, and their command line."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec

from bench.harness.processes import free_port

PEERS_VENV = Path.home() / ".cache" / "kvroute-bench" / "peers-venv"
#: PyPI package: its module with `launch_router`, and its flag for quiet logs
PEERS = {
    "sglang-router": ("sglang_router", "--log-level", "warn"),
    "vllm-router": ("vllm_router", "--log-level", "warning"),
}
#: kvroute bench's peer rows: (PyPI package, its --policy)
PEER_ROWS = (
    ("sglang-router", "cache_aware"),
    ("sglang-router", "round_robin"),
    ("vllm-router", "cache_aware"),
)
#: and for a workload whose requests name their session: each peer's session mode
#: (sglang-router's by its routing-key header, vllm-router's by X-Session-ID)
SESSION_ROWS = (
    ("sglang-router", "manual"),
    ("vllm-router", "consistent_hash"),
)


class Peer(msgspec.Struct, frozen=True, kw_only=True):
    """A Rust router from PyPI with one of its policies: one row of kvroute bench's table."""

    package: str
    policy: str
    python: str | None  # the peers virtualenv's interpreter; None: it cannot run
    version: str  # or why it cannot run

    @property
    def label(self) -> str:
        return f"{self.package}:{self.policy}"


def find_peers(venv: Path, install: bool, sessions: bool = False) -> tuple[Peer, ...]:
    """Each peer row (with `sessions`, the session modes' too), its package pip-installed
    into `venv` first unless not `install`."""
    found = ensure_peers(venv, install)
    return tuple(
        Peer(
            package=package,
            policy=policy,
            python=None if found[package][0] is None else str(found[package][0]),
            version=found[package][1],
        )
        for package, policy in (*PEER_ROWS, *(SESSION_ROWS if sessions else ()))
    )


def peer_cmd(
    python: Path, package: str, backends: Sequence[str], port: int, policy: str = "round_robin"
) -> list[str]:
    """The peer on 127.0.0.1:`port` with `policy` (its own defaults for the policy's knobs);
    its Prometheus listener on a free port, so that several can run at once."""
    module, level_flag, level = PEERS[package]
    return [
        str(python),
        "-m",
        f"{module}.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *backends,
        "--policy",
        policy,
        "--prometheus-port",
        str(free_port()),
        level_flag,
        level,
    ]


def ensure_peers(venv: Path, install: bool) -> dict[str, tuple[Path | None, str]]:
    """Per peer: (its venv's python, version) or (None, why it cannot run)."""
    python = venv / "bin" / "python"
    if not python.exists():
        if not install:
            return {p: (None, f"not installed in {venv} (--no-install)") for p in PEERS}
        venv.parent.mkdir(parents=True, exist_ok=True)
        made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True)
        if made.returncode:
            why = f"cannot create {venv}: {made.stderr.decode()[-200:]}"
            return {p: (None, why) for p in PEERS}
    return {p: _ensure_peer(python, p, install) for p in PEERS}


def _peer_version(python: Path, package: str) -> str | None:
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def _ensure_peer(python: Path, package: str, install: bool) -> tuple[Path | None, str]:
    version = _peer_version(python, package)
    if version is None and install:
        print(f"installing {package} into {python.parent.parent} ...", flush=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        done = subprocess.run([*pip, package], capture_output=True, text=True, timeout=600)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            return None, f"pip install {package} failed: {last[:200]}"
        version = _peer_version(python, package)
    if version is None:
        return None, f"{package} is not installed"
    return python, version
