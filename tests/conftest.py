"""Test-wide settings: functional tests (files named *_functional.py) run on both the
stdlib event loop and uvloop; other async tests run on uvloop, as the daemon does."""

from __future__ import annotations

import asyncio

import uvloop

_BOTH = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
_UVLOOP = {"uvloop": uvloop.new_event_loop}


def pytest_asyncio_loop_factories(config, item):
    return _BOTH if item.path.name.endswith("_functional.py") else _UVLOOP
