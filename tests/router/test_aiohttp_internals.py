"""The aiohttp internals router/ingress/web.py builds on, checked by name and shape.

The router runs aiohttp's server behind its fast path and subclasses its connection
handler (router/ingress/web.py `IngressHandler`: its queued messages, its waiter, the
request in progress), so pyproject.toml allows any aiohttp 3.x from the one tested on.
A release that renames or reshapes one of these fails here, saying what to look at,
instead of failing requests."""

from __future__ import annotations

import inspect

import aiohttp
import pytest
from aiohttp import http, http_exceptions, http_writer, streams, web, web_urldispatcher

from router.config import LimitsConfig
from router.ingress.web import server_limits

RELEASE = f"aiohttp {aiohttp.__version__}"


def _slots(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ for name in getattr(klass, "__slots__", ())}


@pytest.mark.parametrize("name", ["_messages", "_waiter", "_current_request"])
def test_the_connection_handler_keeps_what_ingress_handler_reads(name: str) -> None:
    assert name in _slots(web.RequestHandler), (
        f"{RELEASE}: RequestHandler has no {name}; IngressHandler.data_received / "
        "eof_received in router/ingress/web.py read it"
    )


def test_the_handlers_constructor_takes_the_routers_server_settings() -> None:
    accepted = set(inspect.signature(web.RequestHandler.__init__).parameters)
    given = {"loop", "access_log", *server_limits(LimitsConfig())}
    assert given <= accepted, f"{RELEASE}: RequestHandler no longer takes {given - accepted}"


def test_handle_error_keeps_its_signature() -> None:
    params = list(inspect.signature(web.RequestHandler.handle_error).parameters)
    assert params == ["self", "request", "status", "exc", "message"], (
        f"{RELEASE}: RequestHandler.handle_error is now {params}; IngressHandler overrides it"
    )


def test_the_names_web_py_imports_are_there() -> None:
    assert inspect.iscoroutinefunction(web_urldispatcher._default_expect_handler), RELEASE
    assert http.HttpVersion11 == (1, 1), RELEASE
    for name in ("HttpProcessingError", "LineTooLong", "ContentEncodingError"):
        assert issubclass(getattr(http_exceptions, name), Exception), f"{RELEASE}: {name}"
    assert callable(streams.StreamReader.is_eof), f"{RELEASE}: StreamReader.is_eof"
    assert "output_size" in dir(http_writer.StreamWriter), f"{RELEASE}: writer.output_size"
