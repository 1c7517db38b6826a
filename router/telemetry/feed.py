"""The collector's feed to the workers: its sockets, topics and messages.

With several workers (router/control/supervisor.py) the backends are watched once: the
collector (router/telemetry/collector_feed.py) scrapes and subscribes, and publishes on
a ZMQ PUB socket (IPC) the snapshots scraped in the last `SNAPSHOTS_INTERVAL_S` (`s`,
msgpack [[backend, snapshot], ...]: one message, not one per scrape, for a thousand
backends scraped every second), each KV batch in
sequence order after its gap checks and replays (`k`, backend, then one or more
payloads as the backend sent them: the batches read from its socket at once) and each
index reset (`c`, backend); every worker
(router/telemetry/worker_feed.py) follows that feed instead of the backends and applies
batches to its own index. The collector applies them to an index of its own too. Where
the processes share one index (the supervisor found the room: `WorkerContext.shared_index`)
the collector's application is every worker's, and no batch or reset is sent: every
`HEARD_INTERVAL_S` the workers hear which backends' events came since, and when each
published its last (`h`, msgpack {backend: [time.monotonic() heard, published]}).

The same feed carries the collector's health verdicts and model lists (`p`, after each
probe round, after backends joined its fleet, and to every worker that says hello;
router/fleet/health.py `Verdicts`: only the collector probes; a worker's `REFUSED`
message marks a backend down there and publishes them at once), a worker's placements
to the others (`l`), the admin API's runtime edits (worker 0 pushes an edit to the
collector's PULL socket, `broadcast`; the collector applies it too, so it scrapes,
subscribes to and probes an added backend, and publishes it, `a`) and the collector's
own edits (`announce`: the discovered backends, `a` too); each worker hands an edit to
`on_broadcast`. With `cluster` set, the other replicas' placements come as `l` too (from
worker COLLECTOR) and their summed load per backend as `r` (router/telemetry/cluster.py).

PUB/SUB drops what is published before a subscription reaches the publisher, so a
worker does not serve until its feed is live: it pushes hellos (`hello <n>`) to the
control socket until the collector's welcome comes back on a topic only that worker
subscribes to (`w<n>.`): `j` (joined), the runtime edits that bring a restarted worker's
file-based config to the router's (`e`: backend list, drains), and a snapshot of the
collector's index per backend with events (`i`, published in order with the batches,
so the worker goes on from there). `joined` waits for it, bounded.
"""

from __future__ import annotations

#: a worker's greeting on the control socket, + its index (an admin edit is a JSON object)
HELLO = b"hello "
#: how long a push to the collector may wait before the caller hears it is unreachable
BROADCAST_TIMEOUT_S = 2.0
#: how often a joining worker says hello until the collector answers
HELLO_INTERVAL_S = 0.05
#: how often the collector of a shared index says which backends' KV events came
HEARD_INTERVAL_S = 0.1
#: how often the collector sends the snapshots scraped since (a tenth of the default
#: scrape interval: a snapshot waits at most that long)
SNAPSHOTS_INTERVAL_S = 0.1
#: the topics every worker follows (besides its own, `worker_topic`)
FOLLOWED = (b"s", b"k", b"h", b"c", b"a", b"p", b"l", b"r", b"v")
#: the high-water marks of the feed's two ends: a slow worker loses messages, never
#: the collector
FEED_HWM = 100_000


def worker_topic(worker: bytes) -> bytes:
    """The feed topic of what one joining worker alone needs (`.` ends it: w1 is not w10)."""
    return b"w" + worker + b"."
