"""Every bench command the docs name still runs under that name: each `python -m bench.…`
in README.md, deploy/README.md and docs/*.md answers `--help` with its usage, each
`bench/….py` they cite exists, and so do the `kvroute` commands that load bench/ by
module name. Moving a module without its docs fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import readme

#: `python -m bench.x.y`, its arguments left out (they may run on to the next line)
_MODULE_COMMAND = re.compile(r"\bpython3? -m (bench(?:\.\w+)+)")
#: a file of bench/ cited by path, e.g. `pytest bench/micro/test_bench_relay.py`
_BENCH_PATH = re.compile(r"(?<![\w./-])(bench/[\w/]+\.py)\b")
_HELP_SECONDS = 60


def _found(pattern: re.Pattern[str]) -> dict[str, list[str]]:
    """Each match of `pattern` in the docs, with the pages that name it."""
    found: dict[str, list[str]] = {}
    for page in readme.PAGES:
        for name in sorted(set(pattern.findall(page.read_text()))):
            found.setdefault(name, []).append(str(page.relative_to(readme.ROOT)))
    return found


DOCUMENTED_MODULES = _found(_MODULE_COMMAND)
DOCUMENTED_PATHS = _found(_BENCH_PATH)


def _help(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*cmd, "--help"], capture_output=True, text=True, timeout=_HELP_SECONDS, cwd=readme.ROOT
    )


def test_the_docs_name_bench_commands_and_files() -> None:
    assert DOCUMENTED_MODULES, "no `python -m bench.…` command found in the docs"
    assert DOCUMENTED_PATHS, "no bench/ file cited in the docs"


@pytest.mark.parametrize("module", sorted(DOCUMENTED_MODULES))
def test_each_documented_module_answers_help(module: str) -> None:
    proc = _help([sys.executable, "-m", module])
    where = f"{module}, named in {', '.join(DOCUMENTED_MODULES[module])}"
    assert proc.returncode == 0, f"{where}: exit {proc.returncode}: {proc.stderr[-400:]}"
    assert proc.stdout.startswith("usage:"), f"{where}: no usage printed"


@pytest.mark.parametrize("path", sorted(DOCUMENTED_PATHS))
def test_each_cited_bench_file_exists(path: str) -> None:
    assert (readme.ROOT / path).is_file(), f"{path}, cited in {DOCUMENTED_PATHS[path]}"


@pytest.mark.parametrize("command", ["bench", "demo", "recommend", "sim"])
def test_each_kvroute_bench_tool_answers_help(command: str) -> None:
    kvroute = Path(sys.executable).parent / "kvroute"
    proc = _help([str(kvroute), command])
    assert proc.returncode == 0, f"kvroute {command}: exit {proc.returncode}: {proc.stderr[-400:]}"
    assert proc.stdout.startswith(f"usage: kvroute {command}"), proc.stdout[:200]
