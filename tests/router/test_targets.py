"""router/ingress/targets.py: RFC 3986 §5.2.4's examples, and what a proxied route forwards."""

from __future__ import annotations

import pytest

from router.errors import BadRequest
from router.ingress.targets import origin_form, remove_dot_segments


@pytest.mark.parametrize(
    ("path", "resolved"),
    [
        pytest.param("/a/b/c/./../../g", "/a/g", id="rfc-example"),
        pytest.param("/a/b/c", "/a/b/c", id="none"),
        pytest.param("/a/./b", "/a/b", id="dot"),
        pytest.param("/a/b/..", "/a/", id="trailing-dot-dot"),
        pytest.param("/a/b/.", "/a/b/", id="trailing-dot"),
        pytest.param("/../a", "/a", id="above-the-root"),
        pytest.param("/..", "/", id="only-dot-dot"),
        pytest.param("//a/../b", "//b", id="empty-segments-kept"),
        pytest.param("/a/..b/.c", "/a/..b/.c", id="dots-inside-names"),
    ],
)
def test_remove_dot_segments(path: str, resolved: str) -> None:
    assert remove_dot_segments(path) == resolved


@pytest.mark.parametrize(
    ("target", "prefix", "forwarded"),
    [
        pytest.param("/v2/x?a=/../b#f", "/v2/", "/v2/x?a=/../b", id="query-kept-fragment-not"),
        pytest.param("/v2/a/%2E./b", "/v2/", "/v2/b", id="mixed-encoded-dots"),
        pytest.param("/v2/a%20b", "/v2/", "/v2/a%20b", id="other-escapes-kept"),
        pytest.param("https://h:1/v2/x", "/v2/", "/v2/x", id="absolute"),
        pytest.param("http://h?q", "/", "/?q", id="absolute-no-path"),
        pytest.param("/tokenize", "/tokenize", "/tokenize", id="plain-route"),
        pytest.param("/v2/.well-known", "/v2/", "/v2/.well-known", id="dot-name"),
    ],
)
def test_origin_form(target: str, prefix: str, forwarded: str) -> None:
    assert origin_form(target, prefix) == forwarded


@pytest.mark.parametrize(
    "target",
    [
        pytest.param("/v2/..", id="parent"),
        pytest.param("/v2/%2e%2e/x", id="encoded-parent"),
        pytest.param("/v2/a%2fb", id="encoded-slash"),
        pytest.param("/v2/a%5Cb", id="encoded-backslash"),
        pytest.param("/v2/a\\..\\..\\b", id="backslash"),
        pytest.param("http://h/v3/x", id="absolute-elsewhere"),
    ],
)
def test_origin_form_refuses(target: str) -> None:
    with pytest.raises(BadRequest):
        origin_form(target, "/v2/")
