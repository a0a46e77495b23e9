"""The only I/O towards the engine: GET its Prometheus endpoint, once per reading
(``agent.scrape``, re-exported here; the vLLM pod agent reads its engine with it too, and
must not import this package)."""

from __future__ import annotations

from pd_transfer.agent.scrape import MAX_BYTES, fetch_metrics

__all__ = ["MAX_BYTES", "fetch_metrics"]
