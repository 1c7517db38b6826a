"""How an exchange with a backend broke, as the connection saw it.

router/upstream/proxy.py translates these into router/errors.py's classes (502, 504)
and logs their own words; a retry on a fresh connection is allowed for `Closed` and
`Reset` only (router/upstream/pool.py).
"""


class BackendBroke(Exception):
    """The exchange broke; the message says how (for the log, never for the client)."""


class Closed(BackendBroke):
    """The backend closed the connection before its answer's head was in."""


class Reset(BackendBroke):
    """The connection failed (reset, or another socket error) before the answer's head."""


class Malformed(BackendBroke):
    """The backend's bytes are not HTTP, or not the framing they claim."""


class Cut(BackendBroke):
    """The connection ended before the body did."""


class TransferEncodingError(Cut):
    """A chunked body ended before its last chunk."""


class ContentLengthError(Cut):
    """A body ended before the length its Content-Length header declared."""
