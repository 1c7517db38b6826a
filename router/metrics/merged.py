"""Every process's metric files as one /metrics page, without parsing them anew each scrape.

prometheus-client's `MultiProcessCollector` decodes every record of every process's
file (a JSON key each) and builds a `Sample` per series at every scrape: at 1,024
backends that is ~150,000 series, 4-9 s of a worker's event loop a scrape, and a worker
grown by ~350 MiB. But the files only grow at their ends: a series is appended once and
its value rewritten in place (prometheus_client/mmap_dict.py). So here each record is
decoded once, every scrape re-reads the values as one numpy gather per file, merges
them per series (a sum, or a live gauge's maximum), and formats again only the lines
whose value changed. The page is the library's (`generate_latest` over the merged
files): the same families, samples and values; within a family the samples may come in
another order. Files of a kind this does not merge (gauges of modes kvroute does not
declare) go through the library's merge, as before.
"""

from __future__ import annotations

import glob
import math
import mmap
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import orjson
import xxhash
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString

from router.metrics.values import HEADER, records

#: file kinds merged here (the file name's part before the pid) and how
_SUMMED = ("counter", "histogram", "gauge_livesum", "gauge_sum")
_MAXED = ("gauge_livemax", "gauge_max")
#: distinct values whose text is kept for the next scrape (most are small counts)
_FORMATTED = 65_536


@dataclass(slots=True)
class _Family:
    name: str
    type: str
    help: str
    slots: list[int] = field(default_factory=list)


class _File:
    """One process's file of one kind: its records decoded so far, as value offsets
    (in 8-byte words) and series slots."""

    __slots__ = ("_fd", "_map", "parsed", "slots", "words")

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._map: mmap.mmap | None = None
        self.parsed = HEADER
        self.words = np.zeros(0, np.int64)
        self.slots = np.zeros(0, np.int64)

    def view(self) -> memoryview:
        """The file's bytes (mapped anew when the writer grew it)."""
        size = os.fstat(self._fd).st_size
        if self._map is None or len(self._map) != size:
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(self._fd, size, access=mmap.ACCESS_READ)
        return memoryview(self._map)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
        os.close(self._fd)


class MergedFiles:
    """The merged page of a directory of multiprocess files; `text` is safe to call from
    any thread (one at a time). What it keeps per series is its line's text up to the
    value, and for a histogram's its group and bound: the JSON keys are not kept (a
    key's hash finds its series)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._files: dict[str, _File] = {}
        self._slot: dict[int, int] = {}  # hash of (file kind, key) -> slot
        self._families: dict[str, _Family] = {}
        self._prefix: list[str] = []  # per slot: "name{labels} "
        self._maxed: list[bool] = []
        self._group: list[int] = []  # per slot: its histogram group, or -1
        self._le: list[float] = []  # per slot: its bucket's bound (NaN: not a bucket)
        self._groups: dict[str, int] = {}  # a group's _count line prefix -> group
        self._layout: _Layout | None = None

    def text(self) -> str:
        with self._lock:
            paths = sorted(glob.glob(os.path.join(self._path, "*.db")))
            ours = [p for p in paths if _kind(p) in _SUMMED + _MAXED]
            others = [p for p in paths if _kind(p) not in _SUMMED + _MAXED]
            return self._merged(ours) + _library(others)

    def _merged(self, paths: list[str]) -> str:
        for gone in self._files.keys() - set(paths):
            self._files.pop(gone).close()
        slots, values = [], []
        for path in paths:
            try:
                file = self._files.get(path) or self._files.setdefault(path, _File(path))
                data = file.view()
            except (FileNotFoundError, ValueError):  # gone (a dead process's live gauges)
                continue  # or just made, still empty
            with data:  # released before the file is mapped anew
                used = int.from_bytes(data[:4], "little")
                if used > file.parsed:
                    self._decode(file, data, used, _kind(path))
                slots.append(file.slots)
                values.append(np.frombuffer(data, "<f8")[file.words])
        return self._page(np.concatenate(slots or [np.zeros(0, np.int64)]), values)

    def _decode(self, file: _File, data: memoryview, used: int, kind: str) -> None:
        """The records from where `file` was decoded to `used`: their slots and value
        offsets."""
        words, slots = [], []
        seed = xxhash.xxh3_64_intdigest(kind.encode())
        for key, at in records(data, file.parsed, used):
            slot = self._slot.get(xxhash.xxh3_64_intdigest(key, seed))
            slots.append(self._new_series(kind, key, seed) if slot is None else slot)
            words.append(at // 8)
        if words:
            file.parsed = words[-1] * 8 + 16
        file.words = np.concatenate([file.words, np.array(words, np.int64)])
        file.slots = np.concatenate([file.slots, np.array(slots, np.int64)])

    def _new_series(self, kind: str, key: memoryview, seed: int) -> int:
        metric, name, labels, help_text = orjson.loads(key)
        family = self._families.get(metric)
        if family is None:
            family = self._families[metric] = _Family(metric, kind.partition("_")[0], help_text)
        slot = self._slot[xxhash.xxh3_64_intdigest(key, seed)] = len(self._prefix)
        family.slots.append(slot)
        pairs = sorted(labels.items())
        self._prefix.append(_prefix(name, pairs))
        self._maxed.append(kind in _MAXED)
        le = labels.get("le")
        self._le.append(float(le) if le is not None else math.nan)
        group = -1
        if family.type == "histogram":
            count = _prefix(metric + "_count", [p for p in pairs if p[0] != "le"])
            group = self._groups.setdefault(count, len(self._groups))
        self._group.append(group)
        self._layout = None
        return slot

    def _page(self, slots: np.ndarray, values: list[np.ndarray]) -> str:
        n = len(self._prefix)
        flat = np.concatenate(values) if values else np.zeros(0)
        present = np.bincount(slots, minlength=n) > 0
        layout = self._layout
        if layout is None or not np.array_equal(layout.present, present):
            layout = self._layout = _Layout(self, present)
        merged = np.bincount(slots, weights=flat, minlength=n)
        maxed = layout.maxed_mask[slots]
        if maxed.any():
            top = np.full(n, -np.inf)
            np.maximum.at(top, slots[maxed], flat[maxed])
            merged[layout.maxed] = top[layout.maxed]
        return layout.render(merged)


class _Layout:
    """The page's lines for the series present: where each line's value comes from, and
    its value's text, formatted again only when the value changes."""

    def __init__(self, files: MergedFiles, present: np.ndarray) -> None:
        self.present = present
        self.maxed_mask = np.array(files._maxed, bool)
        self.maxed = np.flatnonzero(self.maxed_mask)
        #: the page: headers, and each line's prefix and value text, to be joined
        self.pieces: list[str] = []
        self._texts: list[int] = []  # per line: where its value text is in `pieces`
        plain: list[tuple[int, int]] = []  # (line, slot)
        buckets: list[list[int]] = []  # per group shown: its bucket slots by bound
        bucket_lines: list[list[int]] = []
        count_lines: list[int] = []
        count_prefix = {group: prefix for prefix, group in files._groups.items()}

        def line(prefix: str) -> int:
            self.pieces += (prefix, "")
            self._texts.append(len(self.pieces) - 1)
            return len(self._texts) - 1

        for family in files._families.values():
            slots = [s for s in family.slots if present[s]]
            if not slots:
                continue
            shown = family.name + "_total" if family.type == "counter" else family.name
            help_text = family.help.replace("\\", r"\\").replace("\n", r"\n")
            self.pieces.append(f"# HELP {shown} {help_text}\n# TYPE {shown} {family.type}\n")
            if family.type != "histogram":
                plain += [(line(files._prefix[s]), s) for s in slots]
                continue
            groups: dict[int, list[tuple[float, int]]] = {}
            sums: dict[int, int] = {}
            for s in slots:
                if math.isnan(files._le[s]):
                    sums[files._group[s]] = s
                else:
                    groups.setdefault(files._group[s], []).append((files._le[s], s))
            below_zero = any(le < 0 for g in groups.values() for le, _ in g)
            for group, members in groups.items():
                members.sort()
                buckets.append([s for _, s in members])
                bucket_lines.append([line(files._prefix[s]) for _, s in members])
                count_lines.append(line(count_prefix[group]))
                if group in sums and not below_zero:
                    plain.append((line(files._prefix[sums[group]]), sums[group]))
        sizes = [len(g) for g in buckets]
        self._plain_lines = np.array([p[0] for p in plain], np.int64)
        self._plain_slots = np.array([p[1] for p in plain], np.int64)
        self._bucket_slots = np.array([s for g in buckets for s in g], np.int64)
        self._bucket_lines = np.array([i for g in bucket_lines for i in g], np.int64)
        self._ends = np.cumsum(sizes, dtype=np.int64)
        self._starts = self._ends - np.array(sizes, np.int64)
        self._group_of = np.repeat(np.arange(len(sizes)), sizes)
        self._count_lines = np.array(count_lines, np.int64)
        self._shown = np.full(len(self._texts), np.nan)
        self._fresh = True
        self._formatted: dict[float, str] = {}

    def render(self, merged: np.ndarray) -> str:
        values = np.empty(len(self._texts))
        values[self._plain_lines] = merged[self._plain_slots]
        if len(self._bucket_slots):
            running = np.cumsum(merged[self._bucket_slots])
            before = np.concatenate([[0.0], running])[self._starts]
            values[self._bucket_lines] = running - before[self._group_of]
            values[self._count_lines] = running[self._ends - 1] - before
        changed = np.flatnonzero((values != self._shown) | self._fresh)
        self._fresh = False
        if len(self._formatted) > _FORMATTED:
            self._formatted.clear()
        pieces, texts, formatted = self.pieces, self._texts, self._formatted
        for i, value in zip(changed.tolist(), values[changed].tolist(), strict=True):
            text = formatted.get(value)
            if text is None:
                text = formatted[value] = floatToGoString(value) + "\n"
            pieces[texts[i]] = text
        self._shown = values
        return "".join(pieces)


def _prefix(name: str, labels: Iterable[tuple[str, str]]) -> str:
    """A sample line's text up to its value, as prometheus-client's exposition writes it."""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return f"{name}{{{inner}}} " if inner else f"{name} "


def _kind(path: str) -> str:
    """A file's kind: `counter_123.db` -> counter, `gauge_livemax_123.db` -> gauge_livemax."""
    return os.path.basename(path).rpartition("_")[0]


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _Files:
    """prometheus-client's merge of `paths`, as a collector."""

    def __init__(self, paths: list[str]) -> None:
        self._paths = paths

    def collect(self) -> Iterable[Metric]:
        return MultiProcessCollector.merge(self._paths, accumulate=True)


def _library(paths: list[str]) -> str:
    """`paths` merged and formatted by prometheus-client, as its collector would."""
    if not paths:
        return ""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Files(paths))
    return generate_latest(registry).decode()
