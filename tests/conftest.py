"""Test-wide settings: functional tests (files named *_functional.py) run on both the
stdlib event loop and uvloop; other async tests run on uvloop, as the daemon does.

Each test run keeps its routers' run directories (router/control/supervisor.py) in a
parent directory of its own, made under $KVROUTE_RUN_PARENT when the caller set one
(else the temporary directory) and removed when the run ends: concurrent runs never see,
nor sweep, each other's."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import pytest
import uvloop

from router.control.supervisor import RUN_PARENT_ENV

_BOTH = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
_UVLOOP = {"uvloop": uvloop.new_event_loop}
#: what RUN_PARENT_ENV was before this run set its own
_CALLERS = pytest.StashKey[str | None]()


def pytest_asyncio_loop_factories(config, item):
    return _BOTH if item.path.name.endswith("_functional.py") else _UVLOOP


def pytest_configure(config: pytest.Config) -> None:
    """This run's parent for run directories, inherited by every router it starts."""
    callers = os.environ.get(RUN_PARENT_ENV)
    config.stash[_CALLERS] = callers
    os.environ[RUN_PARENT_ENV] = tempfile.mkdtemp(prefix="kvroute-tests-", dir=callers)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ[RUN_PARENT_ENV], ignore_errors=True)
    callers = config.stash.get(_CALLERS, None)
    if callers is None:
        os.environ.pop(RUN_PARENT_ENV, None)
    else:
        os.environ[RUN_PARENT_ENV] = callers
