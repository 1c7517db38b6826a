"""Which backends hold a block key: the prefix index's reverse map, kept compact.

One entry per key held anywhere (hashing/prefix_index.py keeps it in step with each
backend's `Holdings`), whose value is the holder's name while there is one, a tuple of
names while there are a few and a set once there are more: most keys have one holder, and
a tuple costs a third of a small set's bytes. A plain dict otherwise, so the index's
binary searches read it at a dict's speed. Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["FEW", "Held", "HolderMap", "holder_count"]

#: the backends holding one key: its one holder's name, a tuple of a few, or a set of more
Held = str | tuple[str, ...] | set[str]
#: holders kept in a tuple (a third of a small set's bytes; adding one copies it)
FEW = 8


class HolderMap(dict[int, Held]):
    __slots__ = ()

    def hold(self, keys: Iterable[int], backend: str) -> None:
        """`backend` holds each of `keys` (idempotent: one probe each, as most keys stored
        are new; a loop here rather than a call per key, as a pick inserts its new blocks)."""
        setdefault = self.setdefault
        for key in keys:
            held = setdefault(key, backend)
            if held is backend:
                continue
            kind = held.__class__
            if kind is str:
                if held != backend:
                    self[key] = (held, backend)
            elif kind is tuple:
                if backend not in held:
                    self[key] = (*held, backend) if len(held) < FEW else {*held, backend}
            else:
                held.add(backend)

    def release(self, key: int, backend: str) -> None:
        """`backend` no longer holds `key`; the key goes with its last holder."""
        held = self.get(key)
        if held is None:
            return
        kind = held.__class__
        if kind is str:
            if held == backend:
                del self[key]
            return
        if kind is set:
            held.discard(backend)
            if len(held) > FEW:
                return
        elif backend not in held:
            return
        rest = tuple(name for name in held if name != backend)
        self[key] = rest[0] if len(rest) == 1 else rest


def holder_count(held: Held) -> int:
    return 1 if held.__class__ is str else len(held)
