"""The upstream attempt loop: a request's attempts until a backend gives an answer to
relay, retrying on the policy's next pick without the backends tried (retry.py) only
while nothing reached the client.

Every attempt is released on every way out: an attempt that fails or is retried here,
one cut by an exception (a timeout, the client leaving), and the one that answered,
which the dispatcher releases once the answer is relayed. There is no `await` between
an attempt's creation and the `try` that releases it.

A server error (a 500) retried elsewhere is judged by the next answer to the same
request (attempt.py holds its verdict): a success blames the first backend; another
server error points at the request, so neither backend is blamed and the second answer
is the client's, with no further retry, so a body that makes every vLLM fail cannot
eject healthy backends. An unavailable answer (502-504) or a failed connection says
nothing of the request: the verdict waits for the next answer, else is given at the end.

When no answer came and every candidate was tried, the client gets a 503 with
`Retry-After` (BackendsFailed) at once: a 502 would invite it to retry at once on a
fleet that is down. With candidates left untried (the retry budget ran out), the last
failure is the answer (a 502), and so is a backend's refusal of the router's
credentials: waiting mends no key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection

from router.config import Config
from router.dispatch.accounting import Accounting
from router.dispatch.attempt import Attempt, Attempts, blame
from router.dispatch.call import Call, Routed
from router.dispatch.pick import unavailable
from router.errors import BackendsFailed, KvrouteError, UpstreamCredentialsRefused, UpstreamError
from router.fleet.backend import Backend
from router.fleet.backends import Fleet
from router.fleet.breaker import Outcome, outcome
from router.upstream.proxy import Upstreams
from router.upstream.retry import RetryPolicy

#: the policy's next pick for a call, none of the backends named
Route = Callable[[Call, Collection[str]], Routed]


class Connector:
    """Sends a call on its attempts, over the request path's pooled connections."""

    __slots__ = ("_account", "_attempts", "_fleet", "_retry", "_route", "_timeouts", "_upstreams")

    def __init__(
        self,
        fleet: Fleet,
        attempts: Attempts,
        account: Accounting,
        upstreams: Upstreams,
        route: Route,
    ) -> None:
        self._fleet = fleet
        self._attempts = attempts
        self._account = account
        self._upstreams = upstreams
        self._route = route

    def configure(self, config: Config) -> None:
        """Take the reloadable timeouts and retry rules; requests in flight keep theirs."""
        self._timeouts = config.timeouts
        self._retry = RetryPolicy(config.retries)

    async def connect(
        self, call: Call, attempt: Attempt, deadline: asyncio.Timeout, tried: list[Backend]
    ) -> Attempt:
        """Send `call` on `attempt`, then on each retry's, until a backend gives an answer
        to relay, or no retry is left; each backend attempted is appended to `tried`.

        Returns the attempt holding its slots; its answer may be a backend's own error
        status, passed through. Raises the last failure if no answer came at all.
        """
        held: Attempt | None = None  # a server error retried, waiting for the next answer
        try:
            while True:  # no await between an attempt's creation and its `try`
                tried.append(attempt.backend)
                try:
                    with attempt:
                        await attempt.open(self._upstreams, self._timeouts)
                except BaseException:
                    self._account.finish(attempt, False)
                    raise
                upstream = attempt.upstream
                if held is not None and upstream is not None:
                    held, the_request = _second_opinion(held, attempt)
                    if the_request:
                        return attempt
                if upstream is not None and not self._retry.retryable_status(upstream.status):
                    return attempt
                routed = self._retry_target(call, tried)
                if routed is None and upstream is not None:
                    return attempt
                if routed is None:
                    error = self._gave_up(call, attempt.error, tried)
                    attempt.status = str(error.status)
                    self._account.finish(attempt, False)
                    raise error
                if attempt.server_error:
                    attempt.defer()
                    held = attempt
                self._account.finish(attempt, False, retried=True)
                room = call.started + self._timeouts.total - asyncio.get_running_loop().time()
                deadline.reschedule(None)  # the backoff is bounded by `room`
                await asyncio.sleep(max(0.0, min(self._retry.backoff(len(tried) - 1), room)))
                attempt = self._attempts.begin(routed, call, deadline)
        finally:
            if held is not None:  # no answer came to judge it by: its own verdict
                held.judge(blamed=True)

    def _retry_target(self, call: Call, tried: list[Backend]) -> Routed | None:
        if not self._retry.allows(len(tried)):
            return None
        try:
            return self._route(call, [b.name for b in tried])
        except KvrouteError:  # no other candidate
            return None

    def _gave_up(self, call: Call, error: UpstreamError, tried: list[Backend]) -> UpstreamError:
        """What to answer when no attempt got an answer: the 503 once every candidate
        failed (after the refused ones were marked down, often none is left), else the
        last failure. O(candidates), on this failure path only."""
        if isinstance(error, UpstreamCredentialsRefused):
            return error
        model = call.req.model or ""
        names = {b.name for b in tried}
        if any(b.name not in names for b in self._fleet.view(model).candidates):
            return error
        why = f"{unavailable(model)} Every backend tried failed; last: {error.message}"
        return blame(BackendsFailed(why, retry_after=1), tried[-1])


def _second_opinion(held: Attempt, attempt: Attempt) -> tuple[Attempt | None, bool]:
    """Judge `held`'s server error by `attempt`'s answer to the same request: what is
    still held, and whether the request is at fault (both answered a server error)."""
    verdict = outcome(attempt.upstream.status)
    if verdict is Outcome.SERVER_ERROR:
        held.judge(blamed=False)
        attempt.judge(blamed=False)
        return None, True
    if verdict is Outcome.SUCCESS:
        held.judge(blamed=True)
        return None, False
    return held, False  # unavailable: no word on the request
