"""How a router process's C heap keeps the memory it frees.

glibc hands the top of its heap back to the kernel once more than M_TRIM_THRESHOLD of it
is free, and serves a block over M_MMAP_THRESHOLD (128 KiB at first) from a mapping of
its own, unmapped when freed. A new long prompt's body, its text and its keys are each
hundreds of kilobytes, freed when its request ends, so every one of them had its pages
faulted in anew: ~350 page faults a 100,000-token prompt, about a fifth of the router's
CPU for it. Kept, the next long prompt reuses them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

from router import log

#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: freed heap top kept for the next requests, per process
KEEP_FREED = 32 * 1024 * 1024
#: a block from here up has a mapping of its own (a body near `max_body_bytes`, 16 MiB
#: by default): rare, and given back whole when freed
MAPPED_FROM = 8 * 1024 * 1024

#: an operator's own settings of glibc's malloc, which are kept
_THEIRS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def _set_by_operator() -> bool:
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return "glibc.malloc." in tunables or any(name in os.environ for name in _THEIRS)


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse (KEEP_FREED, MAPPED_FROM); False where the
    C library has no mallopt (musl, macOS) or the operator set malloc's tunables."""
    if _set_by_operator():
        return False
    with contextlib.suppress(OSError, AttributeError):
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        if mallopt(_M_MMAP_THRESHOLD, MAPPED_FROM) and mallopt(_M_TRIM_THRESHOLD, KEEP_FREED):
            return True
    log.server.debug("mallopt not available: freed heap memory goes back to the kernel")
    return False
