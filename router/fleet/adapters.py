"""LoRA adapters loaded on demand, through vLLM's runtime endpoints.

A request for an adapter of `lora.adapters` that no backend serves waits while one
backend loads it (POST /v1/load_lora_adapter, then GET /v1/models until it lists the
adapter, which also puts it in the fleet's views). One load per adapter is in flight in
this process: the requests that arrive meanwhile wait for the same one. The backend is
the usable one holding the fewest adapters this router loaded, then the least busy; at
`max_loras` of them it first unloads its least recently used (POST
/v1/unload_lora_adapter). A backend whose load answers 404 cannot load adapters (vLLM
without runtime LoRA updating, or without the adapter's files): the next is tried, and
it is not asked again for `CANNOT_LOAD_S`, or until it comes back up after being down.
With several workers, two may load one adapter at once: the second gets vLLM's "already
loaded" and counts it as done. The requests for a served adapter pay one dict lookup
(its last use); for any other model, nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

import aiohttp

from router import log
from router.config import LoraConfig
from router.errors import NoBackendAvailable
from router.fleet.backend import Backend
from router.fleet.backends import Fleet
from router.fleet.health import cards_of

_LISTED_POLL_S = 0.05
#: how long a backend that answered a load with 404 is left out of the loads: long
#: enough that a mixed fleet does not pay a refused load per request, short enough that
#: one restarted with runtime loading on (if its health checks missed the restart) is used
CANNOT_LOAD_S = 300.0


class _Refused(aiohttp.ClientError):
    """A POST answered with an error status (`status`)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AdapterLoader:
    def __init__(self, fleet: Fleet, session: aiohttp.ClientSession, cfg: LoraConfig) -> None:
        self._fleet = fleet
        self._session = session
        self._loads: dict[str, asyncio.Task] = {}
        #: per backend, the adapters this router loaded there, least recently used first
        self._loaded: dict[str, OrderedDict[str, None]] = {}
        #: per adapter, the backends it was loaded on
        self._where: dict[str, set[str]] = {}
        #: per backend that cannot load: until when that holds, and its "up" count then
        self._unable: dict[str, tuple[float, int]] = {}
        self.configure(cfg)

    def configure(self, cfg: LoraConfig) -> None:
        self.cfg = cfg
        self._names = frozenset(cfg.adapters) if cfg.load_on_demand else frozenset()

    def wanted(self, model: str | None) -> bool:
        """Whether `model` is an adapter the router may load."""
        return model in self._names

    async def ensure(self, model: str) -> None:
        """Return once a backend serves `model`, loading it if none does; a 503 if it
        cannot be loaded."""
        if self._fleet.view(model).candidates:
            for name in self._where.get(model, ()):
                self._loaded[name].move_to_end(model)
            return
        task = self._loads.get(model)
        if task is None:
            task = self._loads[model] = asyncio.create_task(self._load(model))
            task.add_done_callback(lambda _: self._loads.pop(model, None))
        await asyncio.shield(task)

    async def _load(self, model: str) -> None:
        """Load `model` on the best backend able to, trying the next after one that
        cannot load adapters; a 503 when none is left, or a load fails otherwise."""
        why = ""
        while (backend := self._choose()) is not None:
            try:
                await self._load_on(backend, model)
                return
            except _Refused as exc:
                if exc.status != 404:
                    raise _failed(model, backend, exc) from None
                self._cannot_load(backend, exc)
                why = f" ({backend.name}: {exc})"
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                raise _failed(model, backend, exc) from None
        raise NoBackendAvailable(f"No backend can load the adapter `{model}`{why}.", retry_after=1)

    def _cannot_load(self, backend: Backend, refusal: _Refused) -> None:
        """Leave `backend` out of the loads for a while: it cannot load adapters."""
        self._unable[backend.name] = (time.monotonic() + CANNOT_LOAD_S, _ups(backend))
        log.backends.warning(
            "backend %s cannot load LoRA adapters (%s): left out of the loads for %gs",
            backend.name, refusal, CANNOT_LOAD_S,
        )  # fmt: skip

    async def _load_on(self, backend: Backend, model: str) -> None:
        async with asyncio.timeout(self.cfg.load_timeout):
            await self._make_room(backend)
            body = {"lora_name": model, "lora_path": self.cfg.source.format(name=model)}
            await self._post(backend, "/v1/load_lora_adapter", body, done_if="already")
            await self._until_listed(backend, model)
        self._loaded.setdefault(backend.name, OrderedDict())[model] = None
        self._where.setdefault(model, set()).add(backend.name)
        log.backends.info("adapter %s loaded on %s", model, backend.name)

    def _choose(self) -> Backend | None:
        able = [b for b in self._fleet.members if b.usable and self._may_load(b)]
        return min(
            able, key=lambda b: (len(self._loaded.get(b.name, ())), b.inflight), default=None
        )

    def _may_load(self, backend: Backend) -> bool:
        """False while `backend` is known not to load adapters: its 404 is recent, and
        it has not come back up since."""
        until, ups = self._unable.get(backend.name, (0.0, 0))
        return time.monotonic() >= until or _ups(backend) != ups

    async def _make_room(self, backend: Backend) -> None:
        """Unload `backend`'s least recently used adapters until one more fits; its
        model list is read again after, so no request is routed to an unloaded one."""
        held = self._loaded.setdefault(backend.name, OrderedDict())
        if len(held) < self.cfg.max_loras:
            return
        while len(held) >= self.cfg.max_loras:
            old, _ = held.popitem(last=False)
            self._where.get(old, set()).discard(backend.name)
            await self._post(backend, "/v1/unload_lora_adapter", {"lora_name": old}, "cannot")
            log.backends.info("adapter %s unloaded from %s (used least lately)", old, backend.name)
        await self._refresh(backend)

    async def _post(self, backend: Backend, path: str, body: dict, done_if: str) -> None:
        """POST `body`; an error whose message contains `done_if` (already loaded, or
        not there to unload) means the state wanted holds."""
        async with backend.ask(self._session, "POST", path, json=body) as resp:
            text = await resp.text()
        if resp.status != 200 and done_if not in text:
            raise _Refused(resp.status, f"{path} answered {resp.status}: {text[:200]}")

    async def _until_listed(self, backend: Backend, model: str) -> None:
        """Poll the backend's model list until it names `model` (a load answers before
        the adapter is served on some versions; the caller bounds the wait)."""
        while True:
            await self._refresh(backend)
            if model in (backend.discovered_models or ()):
                return
            await asyncio.sleep(_LISTED_POLL_S)

    async def _refresh(self, backend: Backend) -> None:
        """Read the backend's /v1/models into the fleet's views now."""
        async with backend.ask(self._session, "GET", "/v1/models") as resp:
            body = await resp.read()
        if resp.status == 200:
            self._fleet.set_discovered(backend, cards_of(body))


def _ups(backend: Backend) -> int:
    """How many times `backend` came back up (a restart it was seen down for counts)."""
    return backend.transitions.get("up", 0)


def _failed(model: str, backend: Backend, exc: Exception) -> NoBackendAvailable:
    """The 503 of a load of `model` that failed on `backend` (logged)."""
    why = str(exc) or type(exc).__name__
    log.backends.warning("loading adapter %s on %s failed: %s", model, backend.name, why)
    message = f"The adapter `{model}` could not be loaded on {backend.name}: {why}"
    return NoBackendAvailable(message, retry_after=1)
