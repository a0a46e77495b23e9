"""Serve every rank's transfer metrics on the pod's metrics port, one ``rank`` label apart.

Each rank's ``TransferMetrics`` keeps its own ``CollectorRegistry`` (so ranks never share
a counter by accident). A scrape needs them side by side: ``RankCollector`` re-emits each
rank registry's samples with an added ``rank`` label, and ``serve_metrics`` exposes one
registry holding it with ``prometheus_client``'s own HTTP server (a daemon thread).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = ["RankCollector", "serve_metrics"]


class RankCollector(Collector):
    """Samples of ``registries[i]`` labelled ``rank="i"``, merged family by family."""

    def __init__(self, registries: Sequence[CollectorRegistry]) -> None:
        self._registries = tuple(registries)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for rank, registry in enumerate(self._registries):
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                for sample in family.samples:
                    merged.samples.append(sample._replace(
                        labels={**sample.labels, "rank": str(rank)}))
        yield from families.values()


def serve_metrics(registries: Sequence[CollectorRegistry], host: str, port: int,
                  collectors: Sequence[Collector] = ()) -> Any:
    """Start the HTTP server on ``host:port`` for the rank registries and the pod's own
    ``collectors`` (no rank label); returns prometheus_client's server handle
    (``shutdown()`` stops it)."""
    combined = CollectorRegistry(auto_describe=False)
    combined.register(RankCollector(registries))
    for collector in collectors:
        combined.register(collector)
    server, _thread = start_http_server(port, addr=host, registry=combined)
    return server
