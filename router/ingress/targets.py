"""The request target a proxied route forwards: origin-form, dot segments resolved.

Why: aiohttp routes on the target as sent, so `/v2/../admin` matched `/v2/{tail}` and
reached the backend as such, and an absolute-form target (`POST http://other/v2/x`,
which HTTP/1.1 servers must accept) went on with its scheme and authority. The backend
gets what the route promised instead:

- an absolute-form target loses its scheme and authority (origin-form, RFC 9112 §3.2.1);
- dot segments are removed as RFC 3986 §5.2.4 says, `%2e` counting as a dot (it is
  one: an unreserved character percent-encoded, §6.2.2.2), since backends decode it;
- an encoded slash or backslash (`%2F`, `%5C`) or a raw backslash is refused: a backend
  that decodes it, or treats `\\` as `/`, would see segments no check saw (vLLM's routes
  never need one);
- a path that resolves outside its route's prefix (`/v2/` for `/v2/{tail}`) is refused;
- the query is kept byte for byte (the backend's to read); a fragment is dropped.

Cost: one scan for `%`, `\\` and `/.` on the aiohttp path; nothing on the fast path,
whose exact routes are matched as sent.
"""

from __future__ import annotations

import re

from router.errors import BadRequest

_ABSOLUTE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*")
_ENCODED_DOT = re.compile("%2e", re.IGNORECASE)
_SEPARATOR = re.compile(r"%2f|%5c|\\", re.IGNORECASE)


def origin_form(target: str, prefix: str) -> str:
    """`target` (as sent) as forwarded on a route whose paths start with `prefix`.
    Raises BadRequest for an encoded separator or a path outside `prefix`."""
    absolute = _ABSOLUTE.match(target)
    if absolute is not None:
        target = target[absolute.end() :]
    path, mark, query = target.partition("#")[0].partition("?")
    if not path.startswith("/"):  # `http://host` or `http://host?q`: the root
        path = "/" + path
    if "%" in path or "\\" in path or "/." in path:
        path = _resolved(path)
    if not path.startswith(prefix):
        raise BadRequest(f"The request path resolves outside {prefix} (its dot segments).")
    return path + mark + query


def _resolved(path: str) -> str:
    if _SEPARATOR.search(path):
        raise BadRequest("The request path has an encoded slash or a backslash.")
    return remove_dot_segments(_ENCODED_DOT.sub(".", path))


def remove_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4 for an absolute path: `.` goes, `..` takes the segment before it
    (never above the root), and a trailing one leaves the path ending in `/`."""
    out: list[str] = []
    segments = path.split("/")[1:]
    last = len(segments) - 1
    for i, segment in enumerate(segments):
        if segment not in (".", ".."):
            out.append(segment)
            continue
        if segment == ".." and out:
            out.pop()
        if i == last:
            out.append("")
    return "/" + "/".join(out)
