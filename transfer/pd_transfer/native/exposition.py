"""Prometheus exposition text as plain data, for the mapping tables: ``agent.exposition``
(re-exported here; the vLLM pod agent reads its engine's requests with it too, and must not
import this package)."""

from __future__ import annotations

from pd_transfer.agent.exposition import (
    Family,
    Histogram,
    families_of,
    gauge_sum,
    histogram_of,
    parse_exposition,
    sample_sum,
)

__all__ = ["Family", "Histogram", "families_of", "gauge_sum", "histogram_of",
           "parse_exposition", "sample_sum"]
