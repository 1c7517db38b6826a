"""Backend model discovery and reachability, beside the request path.

Every `interval` seconds each backend's `GET /v1/models` is fetched concurrently (a
slow backend never delays the others): its cards feed `/v1/models` and the per-model
candidate lists, and a connection failure marks it unusable until it answers again.
A timeout keeps the previous state, so a busy backend is never ejected for being slow.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from router import log
from router.backends import Backend, Fleet


class ModelPoller:
    def __init__(
        self, fleet: Fleet, session: aiohttp.ClientSession, interval: float, timeout: float
    ) -> None:
        self._fleet = fleet
        self._session = session
        self._interval = interval
        self._timeout = timeout

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(b) for b in self._fleet.members))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.poll_once()

    async def _poll(self, backend: Backend) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                async with self._session.get(backend.url.with_path("/v1/models")) as resp:
                    body = await resp.read()
        except (aiohttp.ClientConnectionError, OSError) as exc:
            if backend.healthy:
                log.backends.warning("backend %s unreachable: %s", backend.name, exc)
            self._fleet.set_healthy(backend, False)
            return
        except TimeoutError:
            return
        if not backend.healthy:
            log.backends.info("backend %s reachable again", backend.name)
        self._fleet.set_healthy(backend, True)
        if resp.status == 200:
            self._fleet.set_discovered(backend, _cards(body))


def _cards(body: bytes) -> list[dict]:
    try:
        data = orjson.loads(body).get("data")
    except (orjson.JSONDecodeError, AttributeError):
        return []
    return [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []
