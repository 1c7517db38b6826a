"""kvroute bench's and the studies' child processes: start them, wait until they answer,
stop them.

kvroute bench (bench.harness.compare) runs in one event loop, so its simulator and router
replicas are asyncio subprocesses, stopped with an `await`. bench.studies.throughput's phases
each run a loop of their own (`asyncio.run`) between blocking `wrk` runs, so its routers
are plain `subprocess.Popen` children that outlive every loop. Both start kvroute the
same way (`kvroute_serve`), wait with the same poller (`until_200`) and quote the same
log tails (`last_lines`). `redis_server` is the Redis that `kvroute bench --cluster`'s
replicas share, and the tests' (tests/redis_server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import IO

import aiohttp
import msgspec
import orjson

_SIM_START_SECONDS = 30.0
_ROUTER_START_SECONDS = 30.0
_STOP_SECONDS = 10.0
_LOGGED_STOP_SECONDS = 15.0
_COLOURS = re.compile(r"\x1b\[[0-9;]*m")

_Send = Callable[[], AbstractAsyncContextManager[aiohttp.ClientResponse]]

#: a one-token chat request for the studies' instant backend (its model `instant`): what
#: `wait_routable` sends, and what the overhead and throughput studies time
PING_BODY = orjson.dumps(
    {"model": "instant", "messages": [{"role": "user", "content": "ping " * 50}], "max_tokens": 1}
)
JSON_HEADERS = {"Content-Type": "application/json"}


class StartFailed(RuntimeError):
    """A child process exited or never answered; says why (with its output's tail)."""


class ProcessExited(RuntimeError):
    """A process of the fleet exited while it was measured; says which, its exit code and
    its stderr's last lines."""


class Watch:
    """A row's child processes by name, while they run: a replay whose simulator or
    router died measures nothing but failures, so it must be told apart."""

    def __init__(self) -> None:
        self._children: list[tuple[str, asyncio.subprocess.Process, IO[bytes]]] = []

    def add(self, name: str, proc: asyncio.subprocess.Process, stderr: IO[bytes]) -> None:
        self._children.append((name, proc, stderr))

    def exited(self) -> str | None:
        """Which process exited, with its code and its stderr's last lines; None: none."""
        for name, proc, stderr in self._children:
            if proc.returncode is not None:
                tail = _tail(stderr, 5) or ["(nothing on its stderr)"]
                return " | ".join(
                    [f"{name} (pid {proc.pid}) exited with code {proc.returncode}", *tail]
                )
        return None

    async def first_exit(self) -> None:
        """Until one of the processes exits."""
        waits = [asyncio.ensure_future(proc.wait()) for _, proc, _ in self._children]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server(
    workdir: Path, password: str | None = None, port: int | None = None
) -> Iterator[str]:
    """A redis-server on 127.0.0.1 (at `port`, else a free one), nothing persisted: its
    URL while it runs; stopped, and waited for, on the way out. FileNotFoundError when
    redis-server is not installed, StartFailed when it does not start."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (Debian's redis-server package)")
    port = port or free_port()
    args = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
            "--appendonly", "no", "--dir", str(workdir)]  # fmt: skip
    if password is not None:
        args += ["--requirepass", password]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + _SIM_START_SECONDS
        while True:  # until it accepts a connection, bounded
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise StartFailed(f"redis-server did not start on port {port}") from None
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=_STOP_SECONDS)


def on_port(cmd: list[str], port: int) -> list[str]:
    """A router's command listening on `port` (a peer's --port replaced, kvroute's added)."""
    if "--port" in cmd:
        at = cmd.index("--port") + 1
        return [*cmd[:at], str(port), *cmd[at + 1 :]]
    return [*cmd, "--port", str(port), "--log-level", "warning"]


def kvroute_serve(config: object, path: Path) -> list[str]:
    """`kvroute serve` reading `config`, written to `path` as JSON (which is YAML): both
    benchmarks start kvroute as users run it."""
    path.write_bytes(msgspec.json.encode(config))
    return [sys.executable, "-m", "router", "serve", "-c", str(path)]


async def until_200(
    send: _Send, exit_code: Callable[[], int | None], seconds: float, pause: float
) -> int | None:
    """Poll with `send` until it answers 200 (None) or the process exits (its exit code);
    TimeoutError once `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while (code := exit_code()) is None:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with send() as resp:
                if resp.status == 200:
                    return None
        if time.monotonic() > deadline:
            raise TimeoutError
        await asyncio.sleep(pause)
    return code


def last_lines(text: str, lines: int, width: int) -> list[str]:
    """The last `lines` lines of a process's output, each cut to `width` characters."""
    return [line.strip()[:width] for line in text.strip().splitlines()[-lines:]]


# --- kvroute bench: asyncio children ---------------------------------------------------


@contextlib.asynccontextmanager
async def simulator(
    backends: int, time_scale: float, sim_args: Sequence[str], watch: Watch | None = None
) -> AsyncIterator[tuple[list[dict], int]]:
    """`backends` simulated servers in a child process (in `watch`, if given); yields
    their backend configs and its pid. StartFailed with its stderr's tail if it does not
    announce them in time."""
    cmd = [sys.executable, "-m", "bench.sim", "--instances", str(backends)]
    cmd += ["--time-scale", str(time_scale), "--host", "127.0.0.1", *sim_args]
    kv_events = "--kv-events" in sim_args
    with tempfile.TemporaryFile() as stderr:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=stderr
        )
        if watch is not None:
            watch.add("the simulator", proc, stderr)
        try:
            yield await _announced(proc, backends, kv_events, stderr), proc.pid
        finally:
            await stop(proc)


async def _announced(
    proc: asyncio.subprocess.Process, n: int, kv_events: bool, stderr: IO[bytes]
) -> list[dict]:
    """Backend configs from the simulator's stdout: n URL lines, then with --kv-events n
    lines `kv-events URL pub=ENDPOINT replay=ENDPOINT` (bench/sim/cli.py)."""
    assert proc.stdout is not None
    lines: list[str] = []
    expected = 2 * n if kv_events else n
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_SIM_START_SECONDS):
            while len(lines) < expected and (line := await proc.stdout.readline()):
                lines.append(line.decode().strip())
    if len(lines) < expected:
        raise StartFailed("\n  ".join(_tail(stderr, 5) or ["?"]))
    # fixed names: the hash ring, hence each prefix's home, is the same in every run
    backends = [{"url": url, "name": f"sim-{i}"} for i, url in enumerate(lines[:n])]
    for backend, line in zip(backends, lines[n:], strict=False):
        fields = dict(field.split("=", 1) for field in line.split()[2:])
        backend["kv_events"] = {"endpoint": fields["pub"], "replay_endpoint": fields["replay"]}
    return backends


@contextlib.asynccontextmanager
async def replicas(
    command: Callable[[int], list[str]],
    ready: str,
    n: int,
    watch: Watch | None = None,
    name: str = "the router",
) -> AsyncIterator[list[tuple[str, int]]]:
    """`n` processes of one router, `command` given each a free port; yields their URLs
    and pids once every one answers 200 on the path `ready`. In `watch` as `name`."""
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                _replica(command, ready, watch, name if n == 1 else f"{name} replica {i}")
            )
            for i in range(n)
        ]


@contextlib.asynccontextmanager
async def _replica(
    command: Callable[[int], list[str]], ready: str, watch: Watch | None, name: str
) -> AsyncIterator[tuple[str, int]]:
    """One router in a process of its own, as in production: its work (parsing,
    tokenizing, KV events) never holds up the load generator's clock. Yields its URL and
    pid once it is ready."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as err:
        proc = await asyncio.create_subprocess_exec(
            *command(port),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=err,
        )
        if watch is not None:
            watch.add(name, proc, err)
        try:
            await _until_ready(url + ready, proc, err)
            yield url, proc.pid
        finally:
            await stop(proc)


async def _until_ready(url: str, proc: asyncio.subprocess.Process, err: IO[bytes]) -> None:
    """Until `url` answers 200; StartFailed with the stderr's tail if the process exits
    first or the start takes too long."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        try:
            code = await until_200(
                lambda: http.get(url), lambda: proc.returncode, _ROUTER_START_SECONDS, 0.1
            )
        except TimeoutError:
            why = f"{url} not 200 after {_ROUTER_START_SECONDS:.0f} s"
            raise StartFailed(" | ".join([why, *_tail(err)])) from None
    if code is not None:
        raise StartFailed(" | ".join([f"exited with code {code}", *_tail(err)]))


def _tail(file: IO[bytes], lines: int = 3) -> list[str]:
    """The last lines a process wrote to `file`, without terminal colours."""
    file.seek(0)
    return last_lines(_COLOURS.sub("", file.read().decode(errors="replace")), lines, 200)


async def stop(proc: asyncio.subprocess.Process) -> None:
    """Terminate `proc`, and kill it if it is still there after a while."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), _STOP_SECONDS)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


# --- the studies and the tests: Popen children --------------------------------------------


@contextlib.contextmanager
def process(
    cmd: list[str],
    stdout: IO | int = subprocess.PIPE,
    env: dict[str, str] | None = None,
    stderr: IO | int = subprocess.DEVNULL,
) -> Iterator[subprocess.Popen]:
    """Run `cmd` until the block ends; `env`: its environment; its stderr dropped unless
    `stderr` says where."""
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_ready(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url + "/ready") as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not become ready")
            await asyncio.sleep(0.1)


@contextlib.contextmanager
def logged(cmd: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """A router process with its output in `log`; stopped (its group, if need be) after."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(_LOGGED_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()


def log_tail(log: Path, lines: int = 3) -> str:
    """The last lines of a router's log on one line; empty if it cannot be read."""
    with contextlib.suppress(OSError):
        return " | ".join(last_lines(log.read_text(errors="replace"), lines, 160))
    return ""


async def wait_routable(url: str, proc: subprocess.Popen, timeout: float = 40.0) -> None:
    """Until a chat request through `url` answers 200 (or the process died)."""
    async with aiohttp.ClientSession() as http:

        def chat() -> AbstractAsyncContextManager[aiohttp.ClientResponse]:
            body, headers = PING_BODY, JSON_HEADERS
            return http.post(url + "/v1/chat/completions", data=body, headers=headers)

        try:
            code = await until_200(chat, proc.poll, timeout, 0.2)
        except TimeoutError:
            raise StartFailed(f"not routing after {timeout:.0f}s") from None
    if code is not None:
        raise StartFailed(f"exited with code {code}")
