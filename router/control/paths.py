"""The files and directories a config asks the workers to write, checked once before
any worker starts (and by `serve --check`): a path no worker can write stops the start
with one line naming its key, instead of every worker failing the same way in turn.

Each is probed as the worker will use it, with no lasting trace: an existing file is
opened for appending (and closed), a directory gets an unnamed temporary file, and a
directory still to be made is judged by its nearest existing ancestor.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Literal

from router.config import Config

#: how a worker writes at a path: a directory of files it makes (with its parents), a
#: database file (with its parents, and its journal files beside it), or a log file
#: appended to in a directory that must exist
Kind = Literal["directory", "database", "log"]


def _written(config: Config) -> list[tuple[str, str, Kind]]:
    """The paths the config has the workers write: (key, path, kind)."""
    paths: list[tuple[str, str, Kind]] = []
    if config.access_log.enabled and config.access_log.path != "-":
        paths.append(("access_log.path", config.access_log.path, "log"))
    if config.capture.enabled:
        paths.append(("capture.path", config.capture.path, "directory"))
    if config.jobs.enabled and config.jobs.store == "sqlite":
        paths.append(("jobs.path", config.jobs.path, "database"))
    if config.usage.records:
        paths.append(("usage.path", config.usage.path, "database"))
    return paths


def unwritable(config: Config) -> str | None:
    """The first configured path a worker could not write, as the line that says so."""
    for key, path, kind in _written(config):
        try:
            _probe(Path(path), kind)
        except OSError as exc:
            return f"$.{key}: {path} is not writable ({exc.strerror or exc})"
    return None


def _probe(path: Path, kind: Kind) -> None:
    """Raise the OSError the worker would meet writing `path` as `kind`."""
    if kind != "directory" and path.exists():
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC))
        if kind == "log":  # appending needs the file alone
            return
    folder = path if kind == "directory" else path.parent
    if kind != "log":  # made with its parents
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
    if not folder.is_dir():
        code = errno.ENOTDIR if folder.exists() else errno.ENOENT
        raise OSError(code, os.strerror(code), str(folder))
    tempfile.TemporaryFile(dir=folder).close()
