"""Dispatch: the one way through, from a parsed `Call` to a relayed answer.

  dispatcher.py       `Dispatcher`, the one place that chains the steps below:
                      admission, the prompt described, the pick, the attempts, the
                      accounting when the answer ends; and the request ids
  call.py             what passes from step to step: the `Call`, a pick's `Routed`
  admission.py        the concurrency caps' slots (429 per tenant), taken at once or
                      handed to the waiters
  waiting.py          admission's wait queue: join, shed, wait, give up; its metrics
                      and refusals
  counts.py           what the caps are checked against: this process's counts
  shared_admission.py admission's counts in shared memory, with several workers
  describe.py         the model check (404) and the prompt described for the policy
                      (exact tokens, fingerprint, block keys)
  pick.py             the policy's pick, pool by pool, and the first attempt begun
                      under the workers' pick lock (the shared load table)
  disaggregation.py   the prefill leg of a request split between a prefill and a
                      decode pool (vLLM's KV connectors)
  connect.py          the attempt loop: retries before the first byte, the 503 when
                      every backend failed
  attempt.py          one attempt on one backend: its in-flight slot, the upstream
                      exchange's opening
  verdict.py          the breaker's verdict on an attempt, a server error's held until
                      the request's fate says whose fault it was
  accounting.py       the request's metrics: decision, retries, outcome, tokens,
                      refusals; its throttled failure warnings
  log_line.py         the request's access log line, and its capture record
  prediction.py       the KV-cache prediction checked against the backend's answer
  learning.py         what a whole stream teaches the fleet: answer lengths, speeds
  tracing.py          OpenTelemetry spans per sampled request, W3C traceparent to the
                      backend
  records.py          a worker's access log and tracer, opened and flushed with it
  shutdown.py         the drain of the open exchanges, and the cut of those left

May import: router.upstream, router.telemetry and everything below them.
"""
