"""The README's "Five minutes with the simulator", run as written, so it cannot rot.

Its blocks are taken from README.md in order: `kvroute sim` and `kvroute serve` are
started as real processes (the installed `kvroute` command), the Python snippet runs
with this interpreter (the real OpenAI SDK), and the `curl` and `kvroute bench` blocks
run in bash. Only the ports change: the README's 8100, 8101 and 8000 become free ones.
What the README says they print is checked against what they print.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.harness.processes import wait_ready
from tests import readme

TITLE = "Five minutes with the simulator"
#: the README's ports: the simulator's two servers, then the router
_PORTS = ("8100", "8101", "8000")
_BIN = Path(sys.executable).parent
_ENV = {**os.environ, "PATH": f"{_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
#: the whole walkthrough, so a hang fails the test instead of stalling the suite
_BUDGET = 60.0


@dataclass(frozen=True)
class Walkthrough:
    """The walkthrough's blocks, in the README's order, with the ports replaced."""

    sim: list[str]
    printed: list[str]  # what the README says the simulator prints
    serve: list[str]
    logged: str  # the line the README says the router logs
    snippet: str
    curl: str
    bench: str


def walkthrough(ports: dict[str, int]) -> Walkthrough:
    text = re.sub(r"\b(8100|8101|8000)\b", lambda m: str(ports[m.group(1)]), readme.section(TITLE))
    found = readme.blocks(text)
    assert [lang for lang, _ in found] == ["bash", "text", "bash", "python", "bash", "bash"]
    (_, sim), (_, printed), (_, serve), (_, snippet), (_, curl), (_, bench) = found
    logged = re.search(r"It logs `([^`]+)`", text)
    assert logged, "the walkthrough says what the router logs"
    return Walkthrough(
        sim=_command(sim, "sim"),
        printed=printed.splitlines(),
        serve=_command(serve, "serve"),
        logged=logged.group(1),
        snippet=snippet,
        curl=curl,
        bench=bench,
    )


def _command(block: str, subcommand: str) -> list[str]:
    """The one `kvroute SUBCOMMAND ...` line of a block, as argv for the installed command."""
    lines = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(lines) == 1, lines
    argv = shlex.split(lines[0])
    assert argv[:2] == ["kvroute", subcommand], argv
    kvroute = shutil.which("kvroute", path=str(_BIN))
    assert kvroute, f"no kvroute command beside {sys.executable}: pip install -e . first"
    return [kvroute, *argv[1:]]


def _free_ports() -> dict[str, int]:
    """Two consecutive free ports for the simulator's servers, one for the router."""
    while True:
        with socket.socket() as a, socket.socket() as b, socket.socket() as c:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            c.bind(("127.0.0.1", 0))
            return dict(zip(_PORTS, (base, base + 1, c.getsockname()[1]), strict=True))


@asynccontextmanager
async def started(
    argv: list[str], stderr: Path | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A process that is stopped (SIGTERM, then SIGKILL) however the test ends."""
    err = stderr.open("wb") if stderr else asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=err, env=_ENV
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if stderr:
            err.close()


async def run(argv: list[str], timeout: float) -> str:
    """Run to the end; its stdout, or a failure that shows its stderr."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=_ENV,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        with suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
    assert proc.returncode == 0, f"{argv[-1][:200]} exited {proc.returncode}: {err.decode()}"
    return out.decode()


async def _line(stream: asyncio.StreamReader | None) -> str:
    assert stream is not None
    return (await asyncio.wait_for(stream.readline(), 20)).decode().rstrip("\n")


async def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    if shutil.which("curl", path=_ENV["PATH"]) is None:
        pytest.skip("curl is not installed, and the walkthrough uses it")
    steps = walkthrough(_free_ports())
    served = re.search(r"""model=["']([^"']+)["']""", steps.snippet)
    assert served, "the snippet names a model"
    async with asyncio.timeout(_BUDGET):
        async with started(steps.sim) as sim:
            urls = [await _line(sim.stdout) for _ in steps.printed[:-1]]
            said = await _line(sim.stderr)
            assert [*urls, said] == steps.printed, "the simulator prints what the README shows"
            assert f"model {served.group(1)!r}" in said, "the snippet asks for the sim's model"
            backends = [steps.serve[i + 1] for i, a in enumerate(steps.serve) if a == "--backend"]
            assert backends == urls, "the router is put in front of the servers the sim started"
            log = tmp_path / "serve.log"
            async with started(steps.serve, stderr=log):
                router = re.search(r"http://[\d.]+:\d+", steps.logged)
                assert router
                await wait_ready(router.group(0), timeout=30)
                assert steps.logged in log.read_text(), log.read_text()
                answer = await run([sys.executable, "-c", steps.snippet], timeout=20)
                assert answer.strip(), "the snippet prints the streamed answer"
                shown = await run(["bash", "-euo", "pipefail", "-c", steps.curl], timeout=20)
                assert served.group(1) in shown
                assert re.search(r"^x-kvroute-backend: 127\.0\.0\.1:\d+", shown, re.M | re.I)
                assert re.search(r"^kvroute_requests_total\{", shown, re.M), shown
                table = await run(["bash", "-euo", "pipefail", "-c", steps.bench], timeout=40)
                requests = re.search(r"--requests (\d+)", steps.bench)
                assert requests
                ok_fail = rf"^\S+\s+{requests.group(1)}\s+0\s"  # every request ok, none failed
                assert re.search(ok_fail, table, re.M), table
