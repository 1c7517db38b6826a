"""KV_AWARE, one unit per job (policy.py's docstring walks a pick through them).

    params     the `routing:` parameters (KvAwareParams) and the default offload tiers
    policy     KvAwarePolicy: the pick, its steps in order, each delegated to
    scoring    which candidates are scored: the longest prefixes' holders and draws
    cost       what the whole request costs the fleet on one backend, and the caps
    ties       which of the near-cheapest candidates wins: longest prefix, rendezvous
    upkeep     the index and what its own decisions feed it: speculative inserts, the
               workers' shared placements, the backends that publish KV events
    decisions  the last decisions with their scores, for /debug/routing

Pure, as the rest of policies/: the prefix index is hashing/'s (prefix_index.py,
tiered_index.py); the router's telemetry feeds it KV events and answers beside the path.
"""

from policies.kv_aware.params import DEFAULT_TIERS, KvAwareParams, KvTierParams, KvTokenizerParams
from policies.kv_aware.policy import KvAwarePolicy

__all__ = ["DEFAULT_TIERS", "KvAwareParams", "KvAwarePolicy", "KvTierParams", "KvTokenizerParams"]
