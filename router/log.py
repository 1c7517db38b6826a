"""Named loggers, one per subsystem; nothing on the request path logs per request,
except failures, through a `Throttled` logger (a flood of them must not flood the log)."""

import logging
import time

import orjson

root = logging.getLogger("kvroute")
config = logging.getLogger("kvroute.config")
server = logging.getLogger("kvroute.server")
backends = logging.getLogger("kvroute.backends")
#: the requests that failed or were retried (throttled: `requests_failed`)
requests = logging.getLogger("kvroute.requests")
#: aiohttp's own server messages for the data plane (ingress/web.py filters client faults)
http = logging.getLogger("kvroute.http")


class Throttled:
    """A logger for lines that can come once per request (a 5xx, a retry): at most
    `burst` lines per `window` seconds; the next line after the window says how many
    were left out."""

    __slots__ = ("_burst", "_left_out", "_logger", "_said", "_until", "_window")

    def __init__(self, logger: logging.Logger, burst: int = 20, window: float = 10.0) -> None:
        self._logger = logger
        self._burst = burst
        self._window = window
        self._until = 0.0
        self._said = 0
        self._left_out = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now >= self._until:
            if self._left_out:
                self._logger.warning(
                    "%d similar lines left out in the last %.0f s", self._left_out, self._window
                )
            self._until, self._said, self._left_out = now + self._window, 0, 0
        if self._said < self._burst:
            self._said += 1
            self._logger.warning(msg, *args)
        else:
            self._left_out += 1


#: failed and retried requests, one line each while they are rare
requests_failed = Throttled(requests)
#: writes to disk that failed: a full disk fails every one (the access log's, capture's,
#: the usage records')
disk_failed = Throttled(server)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, process, message (and traceback)."""

    converter = time.gmtime

    def __init__(self, process: str | None) -> None:
        super().__init__()
        self._process = process

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self._process:
            fields["process"] = self._process
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(fields).decode()


def setup(level: str, process: str | None = None, fmt: str = "text") -> None:
    """`process` names the process in every line when a router runs several; `fmt`:
    "text", or "json" for one JSON object per line."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        where = f" [{process}]" if process else ""
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s")
        )
    logging.basicConfig(level=level.upper(), handlers=[handler])
