"""hashing/__init__: the public surface, and importing it loads no I/O stack (the static
rule, no I/O or project imports, is a `lint-imports` contract in pyproject.toml)."""

import json
import subprocess
import sys
from pathlib import Path

import hashing

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hashing"
FORBIDDEN = {
    "asyncio",
    "aiohttp",
    "grpc",
    "prometheus_client",
    "router",
    "policies",
    "tokenizers",
    "jinja2",
}


def test_all_names_the_modules():
    assert sorted(hashing.__all__) == sorted(
        path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__"
    )
    for name in hashing.__all__:
        assert getattr(hashing, name).__name__ == f"hashing.{name}"


def test_importing_hashing_loads_no_io_stack_and_no_tokenizer():
    code = (
        "import json, sys, hashing; "
        "print(json.dumps(sorted({m.partition('.')[0] for m in sys.modules})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert set(json.loads(result.stdout)) & FORBIDDEN == set()
