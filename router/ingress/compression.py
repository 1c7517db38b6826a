"""Response compression: which content coding an answer gets, and the encoders.

`Compression.choose` reads a request's Accept-Encoding (RFC 9110 §12.5.3): codings
case-insensitive, each with an optional `q` weight (`q=0`: not acceptable), `*` for any
coding not named, `identity` for none, `x-gzip` as gzip. It picks the coding of highest
q among those offered (`compression.algorithms`), ties going to the router's order;
`identity` (or `*`) weighted above it means no compression. A header that names nothing
offered, or no header, means no compression too: the router never compresses unasked.
Choices are cached by header value, since clients send a handful of distinct ones.

A `Coding` compresses a whole answer in one call (`whole`), or makes a `StreamEncoder`
for a stream: every `compress(chunk)` returns output flushed to a block boundary, so
what the client has received always decodes to every chunk given so far (gzip's
Z_SYNC_FLUSH, zstd's block flush: each costs a few bytes of framing per call), and
`finish()` returns the trailer. A stream's encoder is kept small on purpose (a 4 KiB
gzip window, a 16 KiB zstd window): it lives as long as its stream, thousands of them
at once, and consecutive SSE events repeat each other within a few hundred bytes.
With the libraries' defaults an open stream held ~190 KiB (gzip) and ~870 KiB (zstd
level 3), against ~34 KiB and ~100 KiB here, for a stream 1% (zstd) and 3-14% (gzip)
larger (bench/studies/compression.py).
"""

from __future__ import annotations

import functools
import threading
import zlib
from collections.abc import Iterable
from typing import Protocol

import zstandard

from router.config import CompressionConfig, ContentCoding

__all__ = ["Coding", "Compression", "StreamEncoder"]

#: distinct Accept-Encoding values whose choice is kept
_CACHED_HEADERS = 64
#: gzip framing (RFC 1952) around deflate, for zlib's wbits
_GZIP_FRAMING = 16
#: a stream's gzip window (2**12 = 4 KiB) and hash memory (zlib's memLevel)
_STREAM_GZIP_WBITS = 12
_STREAM_GZIP_MEMLEVEL = 5
#: a stream's zstd window (2**14 = 16 KiB) and its match tables' sizes
_STREAM_ZSTD_WINDOW_LOG = 14
_STREAM_ZSTD_TABLE_LOG = 12


class StreamEncoder(Protocol):
    """One stream's compressor: each `compress` output decodes on its own."""

    def compress(self, chunk: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


class Coding(Protocol):
    """A content coding the router offers."""

    name: ContentCoding
    #: whole answers shorter than this go as they are
    min_bytes: int

    def whole(self, body: bytes) -> bytes:
        """`body` compressed in one call; safe from any thread."""

    def stream(self) -> StreamEncoder: ...


class _GzipStream:
    __slots__ = ("_z",)

    def __init__(self, level: int) -> None:
        wbits = _GZIP_FRAMING + _STREAM_GZIP_WBITS
        self._z = zlib.compressobj(level, zlib.DEFLATED, wbits, _STREAM_GZIP_MEMLEVEL)

    def compress(self, chunk: bytes) -> bytes:
        z = self._z
        return z.compress(chunk) + z.flush(zlib.Z_SYNC_FLUSH)

    def finish(self) -> bytes:
        return self._z.flush(zlib.Z_FINISH)


class _Gzip:
    __slots__ = ("_level", "min_bytes")

    name = "gzip"

    def __init__(self, level: int, min_bytes: int) -> None:
        self._level = level
        self.min_bytes = min_bytes

    def whole(self, body: bytes) -> bytes:
        return zlib.compress(body, self._level, _GZIP_FRAMING + zlib.MAX_WBITS)

    def stream(self) -> _GzipStream:
        return _GzipStream(self._level)


class _ZstdStream:
    __slots__ = ("_z",)

    def __init__(self, params: zstandard.ZstdCompressionParameters) -> None:
        # a compressor of its own: one ZstdCompressor serves one operation at a time
        self._z = zstandard.ZstdCompressor(compression_params=params).compressobj()

    def compress(self, chunk: bytes) -> bytes:
        z = self._z
        return z.compress(chunk) + z.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)

    def finish(self) -> bytes:
        return self._z.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH)


class _Zstd:
    __slots__ = ("_level", "_local", "_stream_params", "min_bytes")

    name = "zstd"

    def __init__(self, level: int, min_bytes: int) -> None:
        self._level = level
        self.min_bytes = min_bytes
        self._stream_params = zstandard.ZstdCompressionParameters.from_level(
            level,
            window_log=_STREAM_ZSTD_WINDOW_LOG,
            hash_log=_STREAM_ZSTD_TABLE_LOG,
            chain_log=_STREAM_ZSTD_TABLE_LOG,
        )
        self._local = threading.local()  # a compressor per thread, reused (~10 µs to make)

    def whole(self, body: bytes) -> bytes:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = self._local.compressor = zstandard.ZstdCompressor(self._level)
        return compressor.compress(body)

    def stream(self) -> _ZstdStream:
        return _ZstdStream(self._stream_params)


def _coding(name: ContentCoding, config: CompressionConfig) -> Coding:
    if name == "gzip":
        return _Gzip(config.gzip_level, config.min_bytes)
    return _Zstd(config.zstd_level, config.min_bytes)


class Compression:
    """The codings offered (built once from the config) and the choice per request."""

    def __init__(self, config: CompressionConfig) -> None:
        self._offered = tuple(_coding(name, config) for name in config.algorithms)
        self._choice = functools.lru_cache(maxsize=_CACHED_HEADERS)(self._choose)

    def choose(self, accept_encoding: Iterable[str]) -> Coding | None:
        """The coding for an answer to a request with these Accept-Encoding values (its
        header lines, in order); None: identity."""
        return self._choice(", ".join(accept_encoding))

    def _choose(self, header: str) -> Coding | None:
        weights = accepted(header)
        star = weights.get("*")
        best, best_q = None, 0.0
        for coding in self._offered:
            q = weights.get(coding.name, star or 0.0)
            if q > best_q:
                best, best_q = coding, q
        identity = weights.get("identity", star)
        if identity is not None and identity > best_q:
            return None
        return best


def accepted(header: str) -> dict[str, float]:
    """Accept-Encoding's codings (lower case) and their weights; an entry whose weight
    is not a qvalue is left out, as is an empty one."""
    weights: dict[str, float] = {}
    for entry in header.split(","):
        name, *params = entry.split(";")
        name = name.strip().lower()
        q = _weight(params)
        if name and q is not None:
            weights["gzip" if name == "x-gzip" else name] = q
    return weights


def _weight(params: list[str]) -> float | None:
    """The `q` among an entry's parameters (1 when absent); None if it is malformed."""
    for param in params:
        key, _, value = param.partition("=")
        if key.strip().lower() != "q":
            continue
        try:
            q = float(value.strip())
        except ValueError:
            return None
        return q if 0.0 <= q <= 1.0 else None
    return 1.0
