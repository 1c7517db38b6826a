"""Dispatch: the one way through, from a parsed `Call` to a relayed answer.

  dispatcher.py       admission, model check (404), the prompt described for the policy
                      (tokens, fingerprint, block keys), the pick, the in-flight slot,
                      the upstream exchange, retries before the first byte, the
                      accounting (breaker outcome, metrics) when it ends
  admission.py        the wait queue and concurrency caps (429), per tenant
  shared_admission.py admission's counts in shared memory, with several workers

May import: router.upstream, router.telemetry and everything below them.
"""
