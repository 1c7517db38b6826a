"""A small tmpfs for the tests that fill a disk; skipped, with the reason, where none can
be mounted (it needs root and a mount command)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_disk(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `where` meanwhile (skipped where none can be)."""
    where.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
        )
    except FileNotFoundError:
        pytest.skip("no mount command here to make a small filesystem")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (root only): {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)
