"""Named loggers, one per subsystem; nothing on the request path logs per request."""

import logging

root = logging.getLogger("kvroute")
config = logging.getLogger("kvroute.config")
server = logging.getLogger("kvroute.server")
backends = logging.getLogger("kvroute.backends")
#: aiohttp's own server messages for the data plane (ingress/web.py filters client faults)
http = logging.getLogger("kvroute.http")


def setup(level: str, process: str | None = None) -> None:
    """`process` names the process in every line when a router runs several."""
    where = f" [{process}]" if process else ""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s",
    )
