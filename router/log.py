"""Named loggers, one per subsystem; nothing on the request path logs per request."""

import logging

root = logging.getLogger("kvroute")
config = logging.getLogger("kvroute.config")
server = logging.getLogger("kvroute.server")
backends = logging.getLogger("kvroute.backends")
#: aiohttp's own server messages for the data plane (http_ingress filters client faults)
http = logging.getLogger("kvroute.http")


def setup(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
