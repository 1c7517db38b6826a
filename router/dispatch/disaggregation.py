"""Disaggregated serving: a chat or completion request is prefilled on a backend of a
`prefill` pool, then decoded on one of a `decode` pool, as vLLM's KV connectors
(NixlConnector and the others) expect of their proxy.

The prefill leg sends the request with `max_tokens` 1, not streamed, and
`kv_transfer_params: {do_remote_decode: true, ...}`; its answer's `kv_transfer_params`
(where the decode instance reads the KV from) go into the request the decode backend
gets, which answers the client as a whole backend would. The prefill backend is the
policy's pick in the prefill pools, where cache hits pay; the decode pick balances on
decode load (pick.py). A prefill that fails (no answer, an error status, no
`kv_transfer_params`) is tried on another prefill backend, up to `retries.max_retries`
more times, before the client has seen anything; when every try failed, the request is
served whole by a `both` pool if there is one, else it is a 502 naming the last prefill
backend tried (x-kvroute-backend). The decode leg goes through the usual attempts,
retries included; when it fails before the client saw a byte and no decode backend is
left to try, a `both` pool serves it whole, if any.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson

from policies import RouteRequest
from router.config import Config
from router.dispatch.attempt import blame, sent_body
from router.dispatch.call import Call
from router.dispatch.pick import Picker
from router.errors import KvrouteError, UpstreamError
from router.fleet.backend import Backend
from router.fleet.backends import Fleet
from router.fleet.breaker import Outcome, outcome
from router.request import Kind, with_fields

_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_LEGS = (Kind.CHAT, Kind.COMPLETION)


class _PrefillFailed(Exception):
    pass


class Disaggregation:
    def __init__(self, fleet: Fleet, picker: Picker, session: aiohttp.ClientSession) -> None:
        self._fleet = fleet
        self._picker = picker
        self._session = session

    def configure(self, config: Config) -> None:
        self._tries = 1 + config.retries.max_retries
        self._timeout = config.timeouts.first_byte

    def applies(self, call: Call) -> bool:
        return call.kind in _LEGS and call.role is None and self._fleet.disaggregated

    async def prefill(self, call: Call, route_req: RouteRequest, t0: float) -> None:
        """Prefill `call` on a prefill backend and make it a decode request (its body
        carries the transfer, its picks are made in the decode pools); or, with every
        prefill failing, a whole request for a `both` pool, if there is one. `t0`: when
        the first pick's decision began (a retry's begins when it is made)."""
        tried: list[str] = []
        why, last = "", None  # why the last prefill failed, and on which backend
        for _ in range(self._tries):
            try:
                backend = self._picker.pick(route_req, t0, tried, "prefill").backend
            except KvrouteError:
                break  # no prefill backend left to try
            try:
                params = await self._transfer(backend, call, route_req.prompt_tokens)
            except (_PrefillFailed, aiohttp.ClientError, OSError, TimeoutError) as exc:
                tried.append(backend.name)
                why, last = f"{backend.name}: {exc or type(exc).__name__}", backend
                t0 = time.perf_counter()
                continue
            call.body = with_fields(call.body, {"kv_transfer_params": params})
            call.role, call.prefilled_by = "decode", backend.name
            return
        if not self._fleet.has_role("both"):
            failed = UpstreamError(f"The prefill failed on every prefill backend tried ({why}).")
            raise failed if last is None else blame(failed, last)
        call.role = "both"

    def whole_instead(self, call: Call) -> bool:
        """Make a decode with no decode backend left to try a whole request for a
        `both` pool (its transfer dropped), if there is one; False if not."""
        if call.role != "decode" or not self._fleet.has_role("both"):
            return False
        call.body = with_fields(call.body, {}, ("kv_transfer_params",))
        call.role = "both"
        return True

    async def _transfer(self, backend: Backend, call: Call, tokens: int) -> dict:
        """The prefill leg on `backend`, under the model name its pool serves: the
        `kv_transfer_params` it answers with."""
        body = with_fields(
            sent_body(call, self._fleet.renamed(backend, call.req.model)),
            {"max_tokens": 1, "stream": False, "kv_transfer_params": _PREFILL_PARAMS},
            ("stream_options", "max_completion_tokens", "min_tokens"),
        )
        headers = {"Content-Type": "application/json", "X-Request-Id": call.request_id}
        trial = self._fleet.attempt_begins(backend)
        verdict: Outcome | None = Outcome.FAILURE  # unless it answers: unreachable, timed out
        backend.count(1, tokens)
        try:
            async with asyncio.timeout(self._timeout):
                async with backend.ask(
                    self._session, "POST", call.path, data=body, headers=headers
                ) as resp:
                    raw = await resp.read()
            verdict = outcome(resp.status)
        except asyncio.CancelledError:  # the client went: nothing to hold against it
            verdict = None
            raise
        finally:
            backend.count(-1, -tokens)
            self._fleet.attempt_verdict(backend, verdict, trial)
        if resp.status != 200:
            raise _PrefillFailed(f"answered {resp.status}: {raw[:200].decode(errors='replace')}")
        try:
            params = orjson.loads(raw).get("kv_transfer_params")
        except (orjson.JSONDecodeError, AttributeError):
            params = None
        if not isinstance(params, dict):
            raise _PrefillFailed("its answer carries no kv_transfer_params")
        return params
