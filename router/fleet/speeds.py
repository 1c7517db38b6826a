"""What the router learns of each backend's speed, and of its answers' length.

A backend's speed (policies' `Speed`) is learned from the requests the router relays:

- its prefill rate: the tokens a backend prefilled over the time it took, less the step
  they ran in. A sample runs from when its prefill could begin to its first token: from
  when the request was sent, when nothing was queued there (and then, when others were
  running there, half a step later on average: it waited for the step in progress), or
  from the backend's previous first token (every worker's streams'), when one came after
  it was sent: the backend prefills in turn, so the one before it ended then. It counts
  the tokens whose first tokens came in that span and within a quarter step after its
  own (`SETTLE`): the prompts prefilled in the same step as it (vLLM puts several in one
  step, as its token budget allows) have their first tokens then, and are in the sample
  of the first of them, not samples of their own. A prompt's own tokens are its
  uncached ones by its answer's `cached_tokens`, the others' the predicted ones. Where
  prefills were queued ahead of a request but no first token came since it was sent
  (they were not streams, or another router's), the sample counts them whole, from its
  send, and only until `MIN_ALONE` samples of the other kinds exist: they were partly
  done when it came, so such a sample takes their tokens for more work than the backend
  did after. The steps are those learned when the rate is computed, so early samples
  count at the step learned since. Until `MIN_SAMPLES` the rate is the samples' median
  (one span that miscounted, e.g. two prompts prefilled in chunks together counted over
  half their time, would sway a sum of few); then the samples within a factor `_SPREAD`
  of their median rate are summed, tokens over seconds (a long prefill weighs more than
  a short one, mostly the step); only samples of at least `MIN_PREFILL_TOKENS` tokens
  count;
- its decode step, `decode_step_s + decode_s_per_request * running`: each stream's mean
  inter-token gap, less its share of the prefills the backend finished meanwhile (the
  router counts each request's uncached tokens at its first token; chunked prefill put
  them into this stream's steps) at the learned rate, against the requests running
  there while it decoded (the router's in-flight count when it was picked and when it
  ended), fitted by least squares without the samples far off a first fit. While a
  backend has no speed of its own, a stream's first `EARLY_TOKENS` gaps are a sample
  too (router/dispatch/attempt.py), so a slow backend, whose streams end last, is not
  judged at the speed the faster ones set for longer than its first tokens take. Two
  scrapes of the backend's /metrics in a row are a sample as well
  (router/telemetry/scrape.py `decoded_between`): every stream's tokens there, the
  router's or not, against the mean batch between the scrapes.

Each figure comes from the last `RING` samples per worker (all workers' together): the
rate is their median, the line is refit without outliers, so one sample cannot move
either; until `MIN_SAMPLES` exist the configured speed (the prior) stands, but for the
decode step (`MIN_DECODE_SAMPLES`: a mean over many gaps already), and a slope
needs `MIN_SAMPLES` at batches that differ by `MIN_SPREAD` requests. With
several workers the samples live in the shared load table (shared_load.py), each worker
writing its own column, and a worker recomputes a backend's speed from every worker's
samples every `REFRESH` streams of its own there: every worker reads the same samples.

Router replicas (config `cluster`) share their learned speeds (router/telemetry/cluster.py):
a backend this replica has not learned yet takes the others' (`pooled`) before the
fleet's typical one, or the fastest while it is untried (backends.py `lend_speeds`);
while no backend has enough samples of its own, the samples of every backend's streams
together (the fleet's own `SpeedLearner`, this worker's streams) give the stand-in: a
fleet is mostly of one kind, and an engine far from the prior (on CPUs) gets few
samples of its own, since a prefill sample needs `MIN_PREFILL_TOKENS` uncached tokens.
"""

from __future__ import annotations

import statistics
from array import array
from collections.abc import Callable, Iterable
from typing import Protocol

from policies import Speed

#: `max` or `min` over one figure of several speeds
Pick = Callable[[Iterable[float]], float]
#: samples kept per backend per worker, of each kind
RING = 32
#: words per backend per worker: [prefills seen, decodes seen, tokens prefilled, last
#: first token, tokens prefilled by a moment after it, (tokens, seconds, running, tokens
#: ahead)..., (running, gap, tokens prefilled per gap)...]
WORDS = 5 + 7 * RING
MIN_SAMPLES = 8
#: decode samples that give the step (at the prior's slope until `MIN_SAMPLES` give a
#: slope too): each is a stream's mean gap over many tokens, and a slow backend judged
#: at the others' step takes a request every time it is emptiest
MIN_DECODE_SAMPLES = 1
#: while a backend has fewer than `MIN_SAMPLES` decode samples, one whose gaps were more
#: than this share other prompts' prefills (at the rate known then) is no sample: what
#: is left of its gap is the difference of two estimates, and one sample is not trimmed
PREFILL_SHARE = 0.25
#: prefill samples with no prefill of unknown progress ahead that give the rate alone
#: (each is one span of known tokens, timed whole)
MIN_ALONE = 3
#: a sample's tokens ahead when it began as the prefill before it ended
BEHIND = -1
#: first tokens this share of a decode step apart came from one engine step
SETTLE = 0.25
#: a worker computes a backend's speed again after this many of its streams there
REFRESH = 8
MIN_PREFILL_TOKENS = 256
MIN_SPREAD = 4.0
#: a decode sample needs this many tokens after the first (a gap's mean, not one gap)
MIN_DECODE_TOKENS = 8
#: while a backend has no speed of its own, a stream's decode is sampled this many
#: steps (at the speed lent to it) after its first token too (a slow backend's streams
#: end last), from the tokens that came by then if at least `EARLY_MIN_TOKENS`: one
#: half as fast shows it with half the tokens, not twice as late
EARLY_TOKENS = 16
EARLY_MIN_TOKENS = 4
#: a decode sample further off the first fit than this many median misses is left out
_TRIM = 4.0
#: a prefill sample whose rate is off the median by more than this factor is left out
_SPREAD = 3.0
_PREFILLED = 2
_FIRST = 3
_SETTLED = 4
_PREFILLS = 5
_GAPS = 5 + 4 * RING
#: `_SETTLED` while the moment after the last first token has not come
_UNSETTLED = -1.0


def speed_prior(params: object) -> Speed | None:
    """The configured speed of a policy that weighs speeds (KV_AWARE's parameters),
    None for the others."""
    rate = getattr(params, "prefill_tokens_per_s", None)
    if rate is None:
        return None
    return Speed(rate, params.decode_step_s, params.decode_s_per_request)


def pooled(figures: list[tuple[Speed, int]]) -> Speed | None:
    """The mean of several replicas' learned speeds of one backend, figure by figure,
    each weighted by its samples (a replica that saw more streams there knows it
    better); None for none."""
    total = sum(n for _, n in figures)
    if total <= 0:
        return None
    return Speed(*(sum(s[i] * n for s, n in figures) / total for i in range(len(Speed._fields))))


def typical_speed(speeds: list[Speed]) -> Speed | None:
    """The median of `speeds`, figure by figure (None for none)."""
    if not speeds:
        return None
    return Speed(*(statistics.median(figures) for figures in zip(*speeds, strict=True)))


def fastest_speed(speeds: list[Speed]) -> Speed | None:
    """The fastest of `speeds`, figure by figure (None for none)."""
    return _extreme(speeds, max, min)


def slowest_speed(speeds: list[Speed]) -> Speed | None:
    """The slowest of `speeds`, figure by figure (None for none)."""
    return _extreme(speeds, min, max)


def _extreme(speeds: list[Speed], rate: Pick, time: Pick) -> Speed | None:
    if not speeds:
        return None
    rates, steps, per_request = zip(*speeds, strict=True)
    return Speed(rate(rates), time(steps), time(per_request))


class Columns(Protocol):
    """Where the workers' samples live (shared_load.LoadTable)."""

    worker: int | None

    def speed_columns(self, slot: int) -> list[memoryview]: ...

    def speed_column(self, slot: int, worker: int) -> memoryview: ...


class SpeedLearner:
    """One backend's samples: this process's own, or every worker's in `table`'s `slot`
    (views taken per use, so that the table can be closed under it)."""

    __slots__ = ("_local", "_since", "_slot", "_table", "figures")

    def __init__(self, table: Columns | None = None, slot: int | None = None) -> None:
        self._table = None if slot is None else table
        self._slot = slot
        self._local = memoryview(array("d", [0.0] * WORDS))
        #: streams recorded since the speed was last computed
        self._since = 0
        #: the figures (`Speed`'s field names) its samples gave when it was last
        #: computed; the others are the prior's
        self.figures: tuple[str, ...] = ()

    def refreshed(self, prior: Speed, current: Speed | None) -> Speed | None:
        """The speed computed again (`learned`) every `REFRESH` streams this worker
        recorded here (tens of µs each time), else `current` (the last one)."""
        self._since += 1
        if current is not None and self._since < REFRESH:
            return current
        self._since = 0
        return self.learned(prior)

    def _columns(self) -> list[memoryview]:
        """Every worker's samples here (this process's own, alone)."""
        table = self._table
        return [self._local] if table is None else table.speed_columns(self._slot)

    def _own(self) -> memoryview:
        if self._table is None:
            return self._local
        return self._table.speed_column(self._slot, self._table.worker)

    def prefilled(self, tokens: float, seconds: float, running: float, ahead: int = 0) -> None:
        """`tokens` were prefilled in the `seconds` to a first token from when the
        prefill could begin, with `running` other requests there and `ahead` of the
        tokens of prefills queued before it of unknown progress (`BEHIND`: it began as
        the one before it ended)."""
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            own = self._own()
            seen = int(own[0])
            i = _PREFILLS + 4 * (seen % RING)
            own[i], own[i + 1], own[i + 2], own[i + 3] = tokens, seconds, running, ahead
            own[0] = seen + 1

    def decoded(self, running: float, gap: float, beside: float = 0.0) -> None:
        """A stream decoded at a mean of `gap` seconds a token among `running` requests,
        while the backend prefilled `beside` tokens a token of it."""
        if gap > 0:
            own = self._own()
            seen = int(own[1])
            i = _GAPS + 3 * (seen % RING)
            own[i], own[i + 1], own[i + 2] = running, gap, beside
            own[1] = seen + 1

    def first_token(self, now: float) -> tuple[float, float | None]:
        """A stream's first token came here at `now` (`time.perf_counter`, one clock for
        every process): the backend's previous first token, every worker's (0.0 for
        none), and the tokens prefilled here by its `settle`, None before then (this one
        came in the same engine step)."""
        latest = max(self._columns(), key=_first)
        previous, settled = latest[_FIRST], latest[_SETTLED]
        own = self._own()
        own[_FIRST], own[_SETTLED] = now, _UNSETTLED
        return previous, None if settled == _UNSETTLED else settled

    def settle(self, first: float) -> float:
        """A moment after a first token at `first` (its step's others have come): the
        tokens prefilled here by now, kept as where a prefill after it starts counting
        unless this worker had a later first token here since (its own moment keeps it)."""
        own = self._own()
        total = self.prefilled_total()
        if own[_FIRST] == first:
            own[_SETTLED] = total
        return total

    def count_prefilled(self, tokens: int) -> None:
        """A request's `tokens` uncached prompt tokens were prefilled (its first token)."""
        if tokens:
            self._own()[_PREFILLED] += tokens

    def prefilled_total(self) -> float:
        """Every worker's prefilled tokens here so far."""
        return sum(column[_PREFILLED] for column in self._columns())

    def sampled(self) -> bool:
        """Whether any worker has taken a sample here yet (either kind)."""
        return any(column[0] or column[1] for column in self._columns())

    def counted(self) -> int:
        """The samples its figures come from (both kinds, every worker's)."""
        prefills, gaps = self._samples()
        return len(prefills) + len(gaps)

    def learned(self, prior: Speed) -> Speed | None:
        """The speed its samples show, each figure `prior`'s until it has enough of
        them (`figures` names the others); None while every figure is the prior's."""
        prefills, gaps = self._samples()
        self.figures = ()
        # the rate at the prior's step, the step without the prefills beside it at
        # that rate, then the rate again at that step
        rate, timed = _rate(prefills, prior[1], prior[2], prior[0])
        if len(gaps) < MIN_SAMPLES:  # too few to trim: only spans mostly of decoding
            gaps = [(r, g, b) for r, g, b in gaps if b / rate <= g * PREFILL_SHARE]
        if len(prefills) < MIN_SAMPLES and len(gaps) < MIN_DECODE_SAMPLES:
            return None
        step, per_request, sloped = prior[1], prior[2], False
        if len(gaps) >= MIN_DECODE_SAMPLES:
            points = [(r, g - beside / rate) for r, g, beside in gaps]
            step, per_request, sloped = _line(points, per_request)
            rate, timed = _rate(prefills, step, per_request, prior[0])
        learned = (timed, len(gaps) >= MIN_DECODE_SAMPLES, sloped)
        self.figures = tuple(f for f, yes in zip(Speed._fields, learned, strict=True) if yes)
        return Speed(rate, step, per_request)

    def _samples(self) -> tuple[list[tuple[float, ...]], list[tuple[float, ...]]]:
        prefills: list[tuple[float, ...]] = []
        gaps: list[tuple[float, ...]] = []
        for column in self._columns():
            flat = column[_PREFILLS : _PREFILLS + 4 * min(int(column[0]), RING)]
            prefills.extend(zip(flat[0::4], flat[1::4], flat[2::4], flat[3::4], strict=True))
            flat = column[_GAPS : _GAPS + 3 * min(int(column[1]), RING)]
            gaps.extend(zip(flat[0::3], flat[1::3], flat[2::3], strict=True))
        return prefills, gaps


def _rate(
    prefills: list[tuple[float, ...]], step: float, per_request: float, prior: float
) -> tuple[float, bool]:
    """The prefills' tokens over their seconds, each wait less the steps it waited
    for, over the samples within `_SPREAD` of the median rate (their median while fewer
    than `MIN_SAMPLES`): those with no prefill of unknown progress ahead once
    `MIN_ALONE` of them are, else all; `prior` until `MIN_SAMPLES` (then False: not from
    the samples)."""
    timed, alone = [], []
    for tokens, seconds, running, ahead in prefills:
        steps = step + per_request * (running + 1)
        if running and not ahead:  # sent mid-step: half the step in progress first
            steps += (step + per_request * running) / 2
        if seconds > steps:
            timed.append((tokens, seconds - steps))
            if ahead <= 0:
                alone.append(timed[-1])
    if len(alone) >= MIN_ALONE:
        timed = alone
    elif len(timed) < MIN_SAMPLES:
        return prior, False
    median = statistics.median(t / s for t, s in timed)
    if len(timed) < MIN_SAMPLES:  # too few for one span's miscount to weigh little
        return median, True
    kept = [(t, s) for t, s in timed if median / _SPREAD <= t / s <= median * _SPREAD]
    return sum(t for t, _ in kept) / sum(s for _, s in kept), True


def _first(column: memoryview) -> float:
    return column[_FIRST]


def _line(points: list[tuple[float, float]], slope: float) -> tuple[float, float, bool]:
    """(intercept, slope, whether the slope is the points') of gap against running:
    least squares over the points within `_TRIM` median misses of a robust first line
    (through the medians of the smaller and the larger batches), so an outlier cannot
    pull it; with fewer than `MIN_SAMPLES` points or batches that do not differ by
    `MIN_SPREAD`, `slope` is kept and the intercept is the median gap less its batch's
    share. Neither below 0."""
    points.sort()
    half = len(points) // 2
    low, high = points[:half], points[half:]
    fitted = len(points) >= MIN_SAMPLES
    if fitted:
        low_r = statistics.median(r for r, _ in low)
        high_r = statistics.median(r for r, _ in high)
        fitted = high_r - low_r >= MIN_SPREAD
    if fitted:
        low_g = statistics.median(g for _, g in low)
        rough = (statistics.median(g for _, g in high) - low_g) / (high_r - low_r)
        misses = [abs(g - low_g - rough * (r - low_r)) for r, g in points]
        bound = _TRIM * statistics.median(misses)
        kept = [p for p, miss in zip(points, misses, strict=True) if miss <= bound]
        step, slope = _fit(kept) if kept[-1][0] > kept[0][0] else (low_g, rough)
        if slope >= 0:
            return max(0.0, step), slope, True
        slope = 0.0
    return max(0.0, statistics.median(g - slope * r for r, g in points)), slope, fitted


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares (intercept, slope) of points whose first coordinates differ."""
    n = len(points)
    mean_r = sum(r for r, _ in points) / n
    mean_g = sum(g for _, g in points) / n
    var = sum((r - mean_r) ** 2 for r, _ in points)
    slope = sum((r - mean_r) * (g - mean_g) for r, g in points) / var
    return mean_g - slope * mean_r, slope


class AnswerLengths:
    """The median completion tokens of each model's last answers: what a request that
    names no `max_tokens` is expected to generate."""

    __slots__ = ("_medians", "_seen")

    #: answers kept per model, models kept
    KEPT = 64
    MODELS = 256

    def __init__(self) -> None:
        self._seen: dict[str, list[int]] = {}
        self._medians: dict[str, int] = {}

    def add(self, model: str, tokens: int) -> None:
        seen = self._seen.get(model)
        if seen is None:
            if len(self._seen) >= self.MODELS:
                return
            seen = self._seen[model] = []
        seen.append(tokens)
        if len(seen) > self.KEPT:
            del seen[0]
        self._medians[model] = int(statistics.median(seen))

    def expected(self, model: str) -> int:
        """The model's median answer, 0 before its first."""
        return self._medians.get(model, 0)
