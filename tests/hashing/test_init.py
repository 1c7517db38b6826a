"""hashing/__init__: the public surface and the purity rule (no I/O stacks, no project imports)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import hashing

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hashing"
ALLOWED_THIRD_PARTY = {"msgspec", "xxhash", "tokenizers", "jinja2"}
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


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.partition(".")[0])
    return roots


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda path: path.name)
def test_imports_only_stdlib_msgspec_xxhash_and_lazy_tokenizers(path):
    allowed = set(sys.stdlib_module_names) | ALLOWED_THIRD_PARTY | {"hashing"}
    assert _imported_roots(path) - allowed == set()
    assert _imported_roots(path) & {"asyncio", "router", "policies"} == set()


def test_importing_hashing_loads_no_io_stack_and_no_tokenizer():
    code = (
        "import json, sys, hashing; "
        "print(json.dumps(sorted({m.partition('.')[0] for m in sys.modules})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert set(json.loads(result.stdout)) & FORBIDDEN == set()
