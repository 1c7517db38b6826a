"""`kvroute serve --workers N`: one supervisor, N workers on one port, one collector.

Process model (all children are spawned, not forked, so none inherits a running loop):

- **workers** 0..N-1 each run the whole request path (HTTP and gRPC ingress, dispatch,
  circuit breakers) on their own uvloop, listening on the same port with SO_REUSEPORT:
  the kernel spreads connections over them. In-flight counts go through the shared
  `LoadTable` (router/fleet/shared_load.py), so LEAST_OUTSTANDING_REQUESTS, KV_AWARE and
  `concurrency_threshold` see the router's whole load, not one worker's; admission's
  counts through the shared `AdmissionTable` (router/dispatch/shared_admission.py), so
  `max_concurrent_requests` and `max_concurrent_per_tenant` cap the whole router.
- **the collector** scrapes every backend's /metrics, holds the KV event
  subscriptions, runs the health checks and model polls (admission checks of added
  backends included) and the discovery sources once for the router, and publishes
  snapshots, in-order event batches, health verdicts and discovered backends to the
  workers over a ZMQ IPC socket (router/telemetry/feed.py), so 100 backends are scraped and
  probed 100 times per interval, not 100 times N.
- **the supervisor** (this module, no event loop) reserves the ports, creates the run
  directory (shared load table, Prometheus multiprocess files, the IPC socket; see
  "Run directories" below),
  restarts a child that dies (zeroing a dead worker's counters first, with a backoff
  when a child keeps dying young), forwards SIGHUP to every child (each re-reads the
  file) and turns SIGTERM/SIGINT into a graceful stop of every child. A child that
  could not start (a ConfigError or ListenError: a store that does not answer, a file
  it cannot write) says why in one line; one that failed so at every start, the same
  way `GIVE_UP` times, stops the router with that error (exit 2, or 1 for a
  listener), as a single process would, instead of being restarted forever.

/metrics on any worker aggregates every process's counters and histograms
(prometheus-client's multiprocess files), merged by the collector, which primes every
backend's series too, once for the router (router/control/metrics_relay.py); the
per-backend gauges are read from the answering worker, with in-flight counts from the
shared table. The admin API listens in worker 0 only (see router/control/admin.py for
what it can do with several workers).

Run directories (`kvroute-*` in /dev/shm, or in $KVROUTE_RUN_PARENT): the supervisor
removes its own when it stops, but one killed with SIGKILL cannot. So each holds a
shared `flock` on the `owner.lock` file in it for its whole life, as does every child
(a worker left draining by a dead supervisor still uses the tables). An exclusive lock that can be
taken means no live process uses the directory, whatever its PIDs became since: each
supervisor removes such stale directories when it starts (`sweep_stale`). The lock
file appears under its name already locked (a rename), so a directory being created is
never mistaken for a stale one; one without a lock file is left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import multiprocess
from setproctitle import setproctitle

from router import log
from router.config import Config, ConfigError
from router.context import COLLECTOR, RUN_PARENT_ENV, WorkerContext
from router.control.shared_tables import index_room
from router.control.tls import ServingTls
from router.dispatch.shared_admission import AdmissionTable
from router.errors import ListenError, listening
from router.fleet.shared_load import LoadTable

#: backends the shared load table tells apart at once (freed slots are reused), at least
_MIN_SLOTS = 4096
#: a child that dies younger than this is restarted after a growing delay
_YOUNG_SECONDS = 10.0
_MAX_RESTART_DELAY = 30.0
_POLL_SECONDS = 0.2
#: a child that failed the same way at each of this many starts stops the router
GIVE_UP = 3
_PR_SET_PDEATHSIG = 1
RUNDIR_PREFIX = "kvroute-"
#: the run directory's lock: held shared by every live process of its router
OWNER_LOCK = "owner.lock"


def usable_cores() -> int:
    """CPUs this process may run on, capped by a cgroup v2 CPU quota (containers)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def worker_count(config: Config) -> int:
    return config.workers or usable_cores()


def _reserve(what: str, host: str, port: int) -> socket.socket:
    """Bind (without listening) to learn port 0's number and hold it for the workers.

    A first bind without SO_REUSEPORT fails if anything holds the port, so a second
    router started on a busy port stops with "address in use" (a ListenError naming
    `what` and where) instead of silently joining the first one's SO_REUSEPORT group."""
    with listening(what, host, port):
        return _bound(host, port)


def _bound(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(addr)
        addr = probe.getsockname()
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    return sock


def _title(role: str) -> None:
    """Name this process in ps and top ("kvroute: worker 1"), so an operator can tell
    the workers, the collector and the supervisor apart. Within the original command
    line's space only (SPT_NOENV): the environment stays readable in /proc."""
    os.environ["SPT_NOENV"] = "1"  # read at the first call
    setproctitle(f"kvroute: {role}")


def _die_with_parent(parent: int) -> None:
    """SIGTERM this child if the supervisor dies (even by SIGKILL): no orphan keeps
    the port. Linux only (prctl); elsewhere children notice nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _child_main(ctx: WorkerContext, parent: int) -> None:
    """Entry point of every child: build the config and run the router's loop."""
    _die_with_parent(parent)
    _title(ctx.name)
    _hold(Path(ctx.rundir) / OWNER_LOCK)  # until this process exits
    import uvloop

    from router.config import load
    from router.control.reload import ConfigSource
    from router.control.serve import serve

    try:
        config = load(ctx.config_path, ctx.overrides)
        log.setup(config.log_level, ctx.name, config.log_format)
        uvloop.run(serve(config, ConfigSource(ctx.config_path, ctx.overrides), ctx))
    except (ConfigError, ListenError) as exc:  # raised only before it serves
        _failure(ctx).write_text(str(exc))
        sys.exit(2 if isinstance(exc, ConfigError) else 1)


def _failure(ctx: WorkerContext) -> Path:
    """Where a child that could not start leaves why, for the supervisor."""
    return Path(ctx.rundir) / f"{ctx.name.replace(' ', '-')}.failed"


@dataclass
class _Child:
    ctx: WorkerContext
    process: multiprocessing.process.BaseProcess | None = None
    started: float = 0.0
    deaths: int = 0  # in a row, each younger than _YOUNG_SECONDS
    restart_at: float = 0.0
    starts: int = 0
    failure: str = ""  # why it could not start, the last time
    failures: int = 0  # starts in a row that failed so


class Supervisor:
    def __init__(self, config: Config, config_path: str | None, overrides: dict) -> None:
        self.workers = worker_count(config)
        # certificates that do not load stop the start here, not every worker in turn
        ServingTls.load(config)
        # the ports first: a router that cannot listen leaves no run directory behind
        self._sockets = [_reserve("HTTP", config.listen.host, config.listen.port)]
        overrides = {**overrides, "listen.port": self._sockets[0].getsockname()[1]}
        if config.grpc.enabled:
            grpc_host = config.grpc.host or config.listen.host
            self._sockets.append(_reserve("gRPC", grpc_host, config.grpc.port))
            overrides["grpc.port"] = self._sockets[1].getsockname()[1]
        self.port = overrides["listen.port"]
        # a stop asked for from here on is kept, not the default death, which would leave
        # the run directory made next behind (and a caller's SIGTERM answered with -15)
        self._stopping = False
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        self.rundir, self._owner = _new_rundir(_tmpfs())
        metrics_dir = self.rundir / "metrics"
        metrics_dir.mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        slots = max(_MIN_SLOTS, 8 * len(config.backends))
        self.table = LoadTable(f"{self.rundir}/load", slots, self.workers, None)
        self.admission = AdmissionTable(f"{self.rundir}/admission", self.workers, None)
        self._mp = multiprocessing.get_context("spawn")
        shared = index_room(str(self.rundir))
        self._children = [
            _Child(
                WorkerContext(
                    i, self.workers, str(self.rundir), slots, config_path, overrides, shared
                )
            )
            for i in (COLLECTOR, *range(self.workers))
        ]
        self._hup = False
        self._failed: ConfigError | ListenError | None = None  # a child that cannot start
        self._grace = config.shutdown.unready_seconds + config.shutdown.drain_seconds + 10.0

    def run(self) -> int:
        _title("supervisor")
        signal.signal(signal.SIGHUP, self._on_hup)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})  # held since the CLI
        log.server.info(
            "kvroute supervisor %d: %d workers on port %d", os.getpid(), self.workers, self.port
        )
        try:
            for child in self._children:
                if self._stopping:  # asked while starting: none more
                    break
                self._start(child)
            while not self._stopping:
                self._watch()
            self._stop_all()
        finally:
            self.table.close()
            self.admission.close()
            for sock in self._sockets:
                sock.close()
            shutil.rmtree(self.rundir, ignore_errors=True)
            os.close(self._owner)
        log.server.info("kvroute supervisor %d stopped", os.getpid())
        if self._failed is not None:
            raise self._failed
        return 0

    def _on_stop(self, signum: int, frame: object) -> None:
        self._stopping = True

    def _on_hup(self, signum: int, frame: object) -> None:
        self._hup = True

    def _start(self, child: _Child) -> None:
        """Spawn `child` with SIGHUP held: a reload forwarded while it starts waits for
        its `serve` (router/control/serve.py), instead of ending it."""
        process = self._mp.Process(
            target=_child_main, args=(child.ctx, os.getpid()), name=f"kvroute {child.ctx.name}"
        )
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        child.process, child.started = process, time.monotonic()
        child.starts += 1

    def _watch(self) -> None:
        """One turn: restart the dead (after their backoff), forward a SIGHUP."""
        live = [c.process.sentinel for c in self._children if c.process is not None]
        multiprocessing.connection.wait(live, timeout=_POLL_SECONDS)
        now = time.monotonic()
        for child in self._children:
            if child.process is not None and not child.process.is_alive():
                self._buried(child, now)
            elif child.process is None and now >= child.restart_at and not self._stopping:
                self._start(child)
        if self._hup:
            self._hup = False
            self._signal_all(signal.SIGHUP)

    def _buried(self, child: _Child, now: float) -> None:
        """A child died: its in-flight counts and live gauges go; plan its restart."""
        process, child.process = child.process, None
        multiprocess.mark_process_dead(process.pid)
        if not child.ctx.collector:
            self.table.clear_worker(child.ctx.index)
            self.admission.clear_worker(child.ctx.index)
        young = now - child.started < _YOUNG_SECONDS
        child.deaths = child.deaths + 1 if young else 0
        delay = min(_MAX_RESTART_DELAY, 0.5 * 2**child.deaths) if young else 0.0
        child.restart_at = now + delay
        why = _reported(child)
        if child.failures >= GIVE_UP and child.failures == child.starts:
            log.server.error(
                "%s failed at each of its %d starts: stopping", child.ctx.name, child.starts
            )
            error = ConfigError if process.exitcode == 2 else ListenError
            self._failed, self._stopping = error(child.failure), True
            return
        log.server.warning(
            "%s (pid %d) exited with code %s%s; restarting in %.1fs",
            child.ctx.name,
            process.pid,
            process.exitcode,
            f": {why}" if why else "",
            delay,
        )

    def _signal_all(self, signum: int) -> None:
        for child in self._children:
            if child.process is not None and child.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.process.pid, signum)

    def _stop_all(self) -> None:
        """Every child drains as a single router would; stragglers are killed."""
        log.server.info("stopping %d workers and the collector", self.workers)
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self._grace
        for child in self._children:
            if child.process is not None:
                child.process.join(max(0.0, deadline - time.monotonic()))
                if child.process.is_alive():
                    log.server.warning("%s did not stop in time: killed", child.ctx.name)
                    child.process.kill()
                    child.process.join()


def _reported(child: _Child) -> str:
    """Why `child` could not start, if it said (counted in a row); else ""."""
    report = _failure(child.ctx)
    try:
        why = report.read_text()
    except FileNotFoundError:
        child.failures, child.failure = 0, ""
        return ""
    report.unlink()
    child.failures = child.failures + 1 if why == child.failure else 1
    child.failure = why
    return why


def _tmpfs() -> str:
    """Where run directories go: RUN_PARENT_ENV's directory if set (routers that must not
    see each other's, e.g. tests), else /dev/shm when there is one (the load table and
    metric files stay in memory)."""
    if parent := os.environ.get(RUN_PARENT_ENV):
        return parent
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _new_rundir(parent: str) -> tuple[Path, int]:
    """Remove the stale run directories in `parent`, then make this router's; returns
    it and the descriptor holding its lock (shared, like its children's)."""
    sweep_stale(parent)
    rundir = Path(tempfile.mkdtemp(prefix=RUNDIR_PREFIX, dir=parent))
    fd, unnamed = tempfile.mkstemp(dir=rundir)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.rename(unnamed, rundir / OWNER_LOCK)  # named only once locked
    return rundir, fd


def _hold(lock: Path) -> int:
    """Take a shared hold of a run directory's lock; it lasts while the descriptor is
    open (to the process's exit, if never closed)."""
    fd = os.open(lock, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    return fd


def sweep_stale(parent: str | Path) -> None:
    """Remove every run directory in `parent` that no live process holds (its router was
    killed): the shared tables and metric files would stay in memory until reboot."""
    for rundir in Path(parent).glob(RUNDIR_PREFIX + "*"):
        try:
            fd = os.open(rundir / OWNER_LOCK, os.O_RDONLY)
        except OSError:  # no lock file (being made, or not ours), or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live router's
            os.close(fd)
            continue
        try:
            shutil.rmtree(rundir, ignore_errors=True)
            log.server.info("removed the run directory %s of a router that was killed", rundir)
        finally:
            os.close(fd)
