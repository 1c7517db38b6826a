"""The collector: the one process of a multi-process router that faces the backends.

It scrapes every backend's /metrics, holds the KV event subscriptions, runs the health
checks, model polls and discovery sources once for the router, and publishes all of it
to the workers (router/telemetry/feed.py). With `cluster` set it is the replica's one
link to the others (router/telemetry/cluster.py). It serves no request: its one listener,
a Unix socket of the run directory, gives the workers' /metrics every process's counted
series merged (router/control/metrics_relay.py).
"""

from __future__ import annotations

from router.config import Config
from router.control.admin import discovered_edit, replay_edits
from router.control.metrics_relay import CountedServer
from router.control.node import Node
from router.telemetry.cluster import ClusterLink, OwnLoad
from router.telemetry.collector_feed import CollectorTelemetry
from router.telemetry.loops import Parts


class Collector(Node):
    telemetry: CollectorTelemetry
    #: the router's load as the workers count it, for the other replicas (`cluster`)
    _own_load: OwnLoad | None = None
    _counted: CountedServer | None = None

    def _telemetry(self, parts: Parts) -> CollectorTelemetry:
        cluster = None
        if (cfg := self.config.cluster) is not None:
            self._own_load = OwnLoad(self.fleet, self.context)
            block = getattr(self.config.routing, "block_size", 1)
            own = self._own_load
            cluster = ClusterLink(cfg, self.fleet, self.metrics, block, own, own.speeds)
        return CollectorTelemetry(
            parts, self.context, self._edited, self.verdicts, self._replay, cluster
        )

    def _replay(self) -> list[bytes]:
        """The edits that bring a joining worker to the router's runtime view, now."""
        return replay_edits(self)

    async def start(self) -> None:
        """Start in order; on any failure, stop what started and re-raise."""
        try:
            self._label_strategy(self.config)
            self._counted = CountedServer(self.metrics, self.context.metrics_socket)
            await self._counted.start()
            self.start_parts()
            self.run_discovery()
            await self.probe(self.telemetry.publish_verdicts)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        if self._counted is not None:
            await self._counted.stop()
        await self.stop_parts()
        if self._own_load is not None:
            self._own_load.close()

    async def shutdown(self) -> None:
        """It serves nothing: it just stops."""
        await self.stop()

    def configure(self, config: Config) -> None:
        """No request path here: only the strategy the merged series are primed under."""
        self._label_strategy(config)

    def _label_strategy(self, config: Config) -> None:
        """The workers' series of each backend are primed here, under their strategy."""
        self.metrics.strategy = config.strategy

    def reopen_logs(self) -> None:
        """None: the access log is the workers'."""

    def admitted(self) -> None:
        """Backends joined: the workers get their verdicts."""
        self.telemetry.verdicts_changed()

    async def rediscover(self) -> None:
        """Apply the discovered backends here, then hand them to the workers (discovery
        runs once for the router, so every worker routes over one fleet)."""
        await super().rediscover()
        self.telemetry.announce(discovered_edit(self))
