"""A worker's counter and gauge values in its multiprocess files, ~100 bytes each.

prometheus-client's own multiprocess value keeps, per value (each histogram bucket is
one), its creation arguments, its JSON key and the key again in its file's position
table: ~1.4 KB. A worker holds ~140 values per backend it has served or primed, so at
1,024 backends that was ~200 MiB in every worker. Here a value is its file and the
offset of its two doubles there; a file finds a key again by its xxh3 hash. The files
are the library's (same names, same record layout, prometheus_client/mmap_dict.py), so
its reader, router/metrics/merged.py and `mark_process_dead` treat them as before.

`use` installs it for the process: before its first metric (every value of a process
goes to the same files, and two writers of one file would overwrite each other).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections.abc import Iterator

import xxhash
from prometheus_client import values
from prometheus_client.mmap_dict import mmap_key

_FIRST_SIZE = 1 << 16
#: where a file's records start: after its used-bytes word and the word's padding
HEADER = 8
_TWO = struct.Struct("<dd")
_USED = struct.Struct("<i")

#: the process's files, by kind (counter, histogram, gauge_livemax, ...)
_files: dict[str, _File] = {}
#: every write: the loop's, and a scrape thread's priming of new series
_lock = threading.Lock()


class _File:
    """One file of this process: records appended, values rewritten in place."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._size = max(os.fstat(self._fd).st_size, _FIRST_SIZE)
        os.ftruncate(self._fd, self._size)
        self.map = mmap.mmap(self._fd, self._size)
        self._used = _USED.unpack_from(self.map, 0)[0] or HEADER
        self._at: dict[int, int] = {}  # hash of a key -> its value's offset
        for key, at in records(memoryview(self.map), HEADER, self._used):  # an earlier pid's
            self._at[xxhash.xxh3_64_intdigest(key)] = at

    def place(self, key: str) -> int:
        """Where `key`'s value is, appended at 0 when new."""
        encoded = key.encode()
        hashed = xxhash.xxh3_64_intdigest(encoded)
        at = self._at.get(hashed)
        if at is not None:
            return at
        padded = encoded + b" " * (8 - (len(encoded) + 4) % 8)
        record = _USED.pack(len(encoded)) + padded + _TWO.pack(0.0, 0.0)
        while self._used + len(record) > self._size:
            self._size *= 2
            os.ftruncate(self._fd, self._size)
            old, self.map = self.map, mmap.mmap(self._fd, self._size)
            old.close()
        self.map[self._used : self._used + len(record)] = record
        self._used += len(record)
        _USED.pack_into(self.map, 0, self._used)
        at = self._at[hashed] = self._used - 16
        return at


def records(data: memoryview, start: int, used: int) -> Iterator[tuple[memoryview, int]]:
    """Each whole record's key and value offset in a file's bytes from `start` to
    `used` (prometheus_client/mmap_dict.py's layout: the key's length, the key padded to
    8 bytes, the value and its timestamp)."""
    pos = start
    while pos + 4 <= used:
        length = _USED.unpack_from(data, pos)[0]
        at = pos + 4 + length + (8 - (length + 4) % 8)
        if at + 16 > used:
            return
        yield data[pos + 4 : pos + 4 + length], at
        pos = at + 16


class CompactValue:
    """A value of a metric child: its file and offset. The interface of
    prometheus-client's values (`values.ValueClass`)."""

    _multiprocess = True
    __slots__ = ("_at", "_file")

    def __init__(
        self,
        typ: str,
        metric_name: str,
        name: str,
        labelnames: list[str],
        labelvalues: list[str],
        help_text: str,
        multiprocess_mode: str = "",
        **_: object,
    ) -> None:
        kind = f"gauge_{multiprocess_mode}" if typ == "gauge" else typ
        with _lock:
            file = _files.get(kind)
            if file is None:
                directory = os.environ["PROMETHEUS_MULTIPROC_DIR"]
                file = _files[kind] = _File(os.path.join(directory, f"{kind}_{os.getpid()}.db"))
            self._file = file
            self._at = file.place(mmap_key(metric_name, name, labelnames, labelvalues, help_text))

    def inc(self, amount: float) -> None:
        with _lock:
            m = self._file.map
            _TWO.pack_into(m, self._at, _TWO.unpack_from(m, self._at)[0] + amount, 0.0)

    def set(self, value: float, timestamp: float | None = None) -> None:
        with _lock:
            _TWO.pack_into(self._file.map, self._at, value, timestamp or 0.0)

    def get(self) -> float:
        with _lock:
            return _TWO.unpack_from(self._file.map, self._at)[0]

    def set_exemplar(self, exemplar: object) -> None:
        """Multiprocess mode has no exemplars (as prometheus-client's)."""

    def get_exemplar(self) -> None:
        return None


def use() -> None:
    """Every metric value this process creates from now on is a `CompactValue`."""
    values.ValueClass = CompactValue
