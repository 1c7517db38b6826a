"""CPU time and memory of the processes a benchmark starts, read from Linux's /proc.

A router may be a process tree (a supervisor, its workers and the collector), so the
totals walk the tree. /proc counts CPU time in clock ticks (10 ms): shares over spans
shorter than a second are noise, and `cpu_meter` leaves them out.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
_MIN_CPU_SPAN = 1.0  # seconds


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def tree(root: int) -> list[int]:
    """`root` and every descendant."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                children.setdefault(int(_stat_fields(int(entry.name))[1]), []).append(
                    int(entry.name)
                )
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process; None once it is gone."""
    try:
        fields = _stat_fields(pid)
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


def tree_cpu_seconds(root: int) -> float:
    """The same, summed over `root` and its descendants."""
    return sum(filter(None, map(cpu_seconds, tree(root))))


def rss_mb(root: int) -> float:
    """Resident memory of `root` and its descendants, in MiB."""
    total_kb = 0
    for pid in tree(root):
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text()
            found = re.search(r"VmRSS:\s+(\d+) kB", status)
            total_kb += int(found.group(1)) if found else 0
    return total_kb / 1024


def _total_cpu_seconds(pids: Sequence[int]) -> float | None:
    """The CPU seconds of every process in `pids`; None once one of them is gone."""
    times = [cpu_seconds(pid) for pid in pids]
    return None if None in times else sum(filter(None, times))


@contextlib.contextmanager
def cpu_meter(pids: dict[str, Sequence[int]]) -> Iterator[dict[str, float]]:
    """Each named group of processes' CPU time over the block, as a share of one core
    (above 1 when the group, say a router's workers, uses more than one)."""
    shares: dict[str, float] = {}
    t0, start = time.monotonic(), {name: _total_cpu_seconds(p) for name, p in pids.items()}
    yield shares
    elapsed = time.monotonic() - t0
    for name, group in pids.items():
        end, begin = _total_cpu_seconds(group), start[name]
        if end is not None and begin is not None and elapsed >= _MIN_CPU_SPAN:
            shares[name] = (end - begin) / elapsed
