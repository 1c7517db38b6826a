"""One try of a request on one backend: its in-flight slot, the upstream exchange's
opening, and (from its base, verdict.py) the breaker's verdict on it.

An attempt takes its backend's in-flight slot (and the breaker's half-open trial slot,
when it is the trial) as it begins; `release` gives them back, once. The breaker hears
at most one verdict per attempt: at the response headers for a 502, 503 or 504, when
the attempt fails (connection, timeout, cut stream), or else a success once the answer
was relayed whole, so a stream the backend cuts counts as the failure it is; a client
that leaves gives none. A server error (a 500) may be the request's fault rather than
the backend's, so its verdict is held: given at `release`, unless the connector retries
the request elsewhere (`defer`) and lets the next answer decide (`judge`). A refused
connection (nothing listens) is reported at once (`on_refused`: the health checker
marks the backend down).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from time import perf_counter

from policies import Speed
from router.config import TimeoutsConfig
from router.dispatch.call import Call, Routed
from router.dispatch.verdict import Verdict
from router.errors import UpstreamCredentialsRefused, UpstreamError, UpstreamTimeout
from router.fleet.backend import Backend
from router.fleet.backends import Fleet
from router.fleet.breaker import Outcome, outcome
from router.fleet.credentials import REFUSALS, routers_own
from router.fleet.speeds import (
    EARLY_MIN_TOKENS,
    EARLY_TOKENS,
    PREFILL_SHARE,
    SETTLE,
    SpeedLearner,
    speed_prior,
)
from router.metrics import Labelled, Metrics, model_label
from router.request import with_fields
from router.upstream.proxy import Upstream, Upstreams, open_upstream


class Attempts:
    """What every attempt reports to: the fleet (slots and breakers), the metrics, and
    whoever hears of a refused connection."""

    __slots__ = ("fleet", "itl", "metrics", "on_refused")

    def __init__(
        self, fleet: Fleet, metrics: Metrics, on_refused: Callable[[Backend], None] | None
    ) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.on_refused = on_refused
        self.itl = Labelled(metrics.itl)

    def begin(self, routed: Routed, call: Call, timeout: asyncio.Timeout) -> Attempt:
        """An attempt of `call` on `routed`'s backend, holding its slots from now on."""
        return Attempt(self, routed, call, timeout)


class Attempt(Verdict):
    """One try of a request on one backend (this module's docstring says what it holds;
    the breaker's verdict on it is its base's, verdict.py).

    `with attempt:` notes how the attempt ends if an exception ends it.
    """

    __slots__ = (
        "_ended",
        "_itl",
        "_queued",
        "_refused",
        "_started",
        "_timeout",
        "began",
        "call",
        "error",
        "labels",
        "prefilled_after",
        "prefilled_before",
        "prefills_then",
        "routed",
        "sent_at",
        "status",
        "upstream",
    )

    def __init__(
        self, attempts: Attempts, routed: Routed, call: Call, timeout: asyncio.Timeout
    ) -> None:
        self._fleet = fleet = attempts.fleet
        self._metrics = attempts.metrics
        self._refused = attempts.on_refused
        self.routed = routed
        self.backend = backend = routed.backend
        self.call = call
        call.attempts += 1
        #: the request's endpoint and model labels (the model's bounded by the fleet's)
        self.labels = (call.kind.value, model_label(call.req.model, fleet.models))
        self._itl = attempts.itl(backend.name, *self.labels)
        self._queued = routed.prompt_tokens - routed.predicted_cached
        backend.count(1, self._queued)
        #: its answer has begun (it no longer counts as not begun on the backend), ended
        self._started = self._ended = False
        # the verdict's state (verdict.py), set here: no call of its own per attempt
        self._trial = fleet.attempt_begins(backend)
        self._judged = self._deferred = False
        self._held = None
        self.status = "error"
        #: the exchange's timeout: this attempt sets it and hears when it expires
        self._timeout = timeout
        self.upstream: Upstream | None = None
        self.error: UpstreamError | None = None
        #: the backend's prefilled tokens counted when this one's first token came
        self.prefills_then = 0.0
        #: its prefill sample's span (router/fleet/speeds.py): when the request went,
        #: and the previous first token there if one came after that (the prefill
        #: began then); the backend's prefilled tokens at its start (None: it came in
        #: the step of the one before, whose sample counts it) and a moment after its
        #: own first token
        self.sent_at = 0.0
        self.began: float | None = None
        self.prefilled_before: float | None = None
        self.prefilled_after: float | None = None

    async def open(self, upstreams: Upstreams, t: TimeoutsConfig) -> None:
        """Send the request and wait for the answer's headers (`upstream`), or note
        why there is none (`error`) if it failed before the backend answered."""
        call = self.call
        end = call.started + t.total
        self._timeout.reschedule(min(asyncio.get_running_loop().time() + t.first_byte, end))
        backend = self.backend
        if call.trace is not None:
            call.trace.attempt_begins(backend, call.method, call.headers)
        renamed = self._fleet.renamed(backend, call.req.model)
        self.sent_at = perf_counter()
        self.prefilled_before = backend.speed_samples.prefilled_total()
        try:
            upstream = await open_upstream(
                upstreams,
                backend.url,
                backend.prefix + call.path,
                call.method,
                sent_body(call, renamed),
                call.headers,
                t.connect,
                t.idle,
                end,
                self._itl,
                self.prefilled,
                backend,
            )
        except UpstreamError as exc:  # not a timeout: worth a retry elsewhere
            self._note(exc)
            return
        if upstream.status in REFUSALS and routers_own(backend.headers, call.headers):
            upstream.finish(False)  # its answer is about the router, not for the client
            self._note(_refused_credentials(upstream.status))
            return
        upstream.backend_name = backend.name
        upstream.pool = backend.pool
        if renamed is not None and self._fleet.answers_as_asked(backend):
            upstream.answer_as(renamed, call.req.model)
        if call.capture is not None:
            upstream.keep()
        self.upstream = upstream
        self.status = str(upstream.status)
        verdict = outcome(upstream.status)
        if verdict is Outcome.SERVER_ERROR and not self._trial:  # a trial's counts at once
            self._held = verdict
        elif verdict is not Outcome.SUCCESS:  # a success is judged when the answer ended
            self._verdict(verdict)

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb) -> None:
        """Note how the attempt ends if an exception ends it. The exchange's timeout
        cancels the task: a cancellation once it expired is a timeout (a 504)."""
        if isinstance(exc, asyncio.CancelledError) and self._timeout.expired():
            exc = UpstreamTimeout("The backend did not answer in time.")
        if exc is not None:
            self._note(exc)

    def prefilled(self) -> None:
        """The first token arrived: the prompt's tokens no longer queue on the backend,
        they were prefilled (counted, to tell its decode from the prefills beside it)."""
        backend = self.backend
        backend.count(0, -self._queued, -1)
        self._started = True
        samples = backend.speed_samples
        samples.count_prefilled(self._queued)
        self.prefills_then = samples.prefilled_total()
        self._queued = 0
        upstream, prior = self.upstream, speed_prior(self._fleet.policy.params)
        if prior is not None and upstream is not None and upstream.streaming:
            self._first_token(samples, prior)

    def _first_token(self, samples: SpeedLearner, prior: Speed) -> None:
        """Its first token came: note where its prefill sample starts, and count the
        backend's prefilled tokens once its step's other first tokens have come; while
        the backend has no speed of its own, take a decode sample of the stream's
        first `EARLY_TOKENS` too."""
        now = perf_counter()
        previous, settled = samples.first_token(now)
        if previous > self.sent_at:
            self.began, self.prefilled_before = previous, settled
        # the speed lent, not the slowest one a backend with no speed of its own is
        # judged at while it has requests (it always has this one): when to look
        step = (self.backend.lent_speed or prior).decode_step_s
        loop = asyncio.get_running_loop()
        loop.call_later(SETTLE * step, self._settle, samples, now)
        if self.backend.learned_speed is None:
            loop.call_later(EARLY_TOKENS * step, self._decoding, prior, None)

    def _settle(self, samples: SpeedLearner, first: float) -> None:
        self.prefilled_after = samples.settle(first)

    def _decoding(self, prior: Speed, since: tuple[int, float, float] | None) -> None:
        """A decode sample of the tokens the stream had `EARLY_TOKENS` lent steps after
        `since` (its chunks and seconds after its first then, and the backend's
        prefilled tokens; None: `_from_second_chunk`), while its backend has no speed
        of its own: a backend is learned as its first streams decode, not as they end
        (a slow one's end last, and meanwhile it is judged at the speed the faster ones
        set), and one slower than lent shows it with fewer tokens than `EARLY_TOKENS`
        (a slow backend waiting for them took a new conversation every time it was
        emptiest). With fewer than `EARLY_MIN_TOKENS` it is asked again while the
        stream runs; a span more than `PREFILL_SHARE` other prompts' prefills (their
        share of a step is taken off a gap at a rate not learned yet) is passed over."""
        backend, upstream = self.backend, self.upstream
        if backend.learned_speed is not None or upstream is None or self._ended:
            return
        gaps, seconds = upstream.decoding()
        prefilled = backend.speed_samples.prefilled_total()
        speed = backend.lent_speed or prior
        since = since or self._from_second_chunk(upstream)
        if since is not None:
            tokens, span = gaps - since[0], seconds - since[1]
            beside = prefilled - since[2]
            if beside / speed.prefill_tokens_per_s > span * PREFILL_SHARE:  # from here on
                since = (gaps, seconds, prefilled)
            elif tokens >= EARLY_MIN_TOKENS:
                for learner in self._fleet.learners(backend):
                    learner.decoded(*self.decode_sample(tokens, span, beside))
                self._fleet.relearn(backend, prior)
                return
        loop = asyncio.get_running_loop()
        loop.call_later(EARLY_TOKENS * speed.decode_step_s, self._decoding, prior, since)

    def _from_second_chunk(self, upstream: Upstream) -> tuple[int, float, float] | None:
        """Where an early decode sample starts: the stream's second chunk (its chunks
        and seconds after its first then, None before it), and the backend's prefilled
        tokens at its first token. Gaps from the first would count a chat stream's
        opening event (its role, sent with the first token) as a step: a sample of a
        few tokens a quarter short."""
        second = upstream.second_chunk()
        return None if second is None else (1, second, self.prefills_then)

    def decode_sample(
        self, tokens: int, seconds: float, prefilled: float
    ) -> tuple[float, float, float]:
        """A decode sample of `tokens` decoded in `seconds` while the backend prefilled
        `prefilled` tokens: the requests running there (when it was picked and now), the
        mean gap, and the tokens prefilled per token (speeds.py `decoded`)."""
        running = (self.routed.running + self.backend.inflight) / 2 + 1
        return running, seconds / tokens, prefilled / tokens

    def release(self, clean: bool) -> None:
        """Give the slots back; a held server error is judged now unless deferred, an
        answer relayed whole (`clean`) not judged yet is a success, and a trial ending
        without a verdict frees the trial slot."""
        self.backend.count(-1, -self._queued, 0 if self._started else -1)
        self._queued = 0
        self._started = self._ended = True
        if self.server_error:
            if not self._deferred:
                self.judge(blamed=True)
        elif not self._judged and (clean or self._trial):
            self._verdict(Outcome.SUCCESS if clean else None)
        if self.upstream is not None:
            self.upstream.finish(clean)

    def _note(self, exc: BaseException) -> None:
        if isinstance(exc, UpstreamError):
            blame(exc, self.backend)
            self.error, self.status = exc, str(exc.status)
            self._metrics.upstream_errors.labels(self.backend.name, exc.kind).inc()
            self._verdict(Outcome.FAILURE)
            if self._refused is not None and isinstance(exc.__cause__, ConnectionRefusedError):
                self._refused(self.backend)  # proxy raises it from the OSError
        elif isinstance(exc, (asyncio.CancelledError, ConnectionResetError)):
            self.status = "499"  # nginx's "client closed request"
            self._metrics.client_disconnects.labels(self.backend.name).inc()


def sent_body(call: Call, renamed: str | None) -> bytes:
    """`call`'s body as a backend is to get it: the model `renamed` where its pool's
    `model_map` says so (`Fleet.renamed`), else the client's bytes as they came."""
    return call.body if renamed is None else with_fields(call.body, {"model": renamed})


def _refused_credentials(status: int) -> UpstreamCredentialsRefused:
    return UpstreamCredentialsRefused(
        f"The backend refused the router's credentials (HTTP {status}): the router's "
        "api_key for it is wrong or missing."
    )


def blame(err: UpstreamError, backend: Backend) -> UpstreamError:
    """`err`, naming `backend` as the one that failed (the client sees which)."""
    url = backend.url
    err.blame(backend.name, f"{url.host}:{url.port}", backend.pool)
    return err
