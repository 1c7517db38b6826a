"""What a whole stream teaches the fleet: its answer's length for its model, and its
backend's speed (router/fleet/speeds.py) for a policy that weighs speeds."""

from __future__ import annotations

from router.dispatch.attempt import Attempt
from router.fleet.backends import Fleet
from router.fleet.speeds import BEHIND, MIN_DECODE_TOKENS, speed_prior
from router.upstream.usage import Usage


def learn(fleet: Fleet, attempt: Attempt, used: Usage) -> None:
    """Learn from a stream that ended well (its first chunk came). The tokens are its
    usage's, else its events (about one a token)."""
    events, decoding = attempt.upstream.decoding()
    completion = used.completion or events
    if completion:
        fleet.answers.add(attempt.call.req.model or "", completion)
    prior = speed_prior(fleet.policy.params)
    if prior is None:
        return
    routed, backend = attempt.routed, attempt.backend
    samples = backend.speed_samples
    learners = fleet.learners(backend)
    if routed.prompt_tokens:
        sample = _prefill_sample(attempt, used)
        if sample is not None:
            for learner in learners:
                learner.prefilled(*sample)
    if completion > MIN_DECODE_TOKENS:
        beside = samples.prefilled_total() - attempt.prefills_then
        sample = attempt.decode_sample(completion - 1, decoding, beside)
        for learner in learners:
            learner.decoded(*sample)
    fleet.relearn(backend, prior)


def _prefill_sample(attempt: Attempt, used: Usage) -> tuple[float, float, int, int] | None:
    """Its prefill sample (tokens, seconds, running, ahead: router/fleet/speeds.py says
    what each span holds), its own tokens by its answer's cached ones; None when it came
    in the step of the one before (whose sample counts it). A stream that ended before
    its step settled (an answer of a token or two) counts what was prefilled by now."""
    routed = attempt.routed
    cached = routed.predicted_cached if used.cached is None else used.cached
    own = (used.prompt or routed.prompt_tokens) - cached
    first = attempt.upstream.first_chunk_at
    if attempt.began is None and routed.ahead:  # queued behind prefills of unknown progress
        return routed.ahead + own, first - attempt.sent_at, routed.running, routed.ahead
    before, after = attempt.prefilled_before, attempt.prefilled_after
    if before is None:
        return None
    if after is None:
        after = attempt.backend.speed_samples.prefilled_total()
    tokens = after - before + own - (routed.prompt_tokens - routed.predicted_cached)
    if attempt.began is None:
        return tokens, first - attempt.sent_at, routed.running, 0
    return tokens, first - attempt.began, routed.running, BEHIND
