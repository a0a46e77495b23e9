"""The metadata vetting counters on a rank's metrics (common/metrics.py, attach_vetting):
read at scrape time from the transport, in Prometheus' exposition."""

from __future__ import annotations

from prometheus_client import generate_latest

from pd_transfer.common.metrics import TransferMetrics
from pd_transfer.protocol.lifecycle import Role
from pd_transfer.transport.base import VettingStats


def test_the_vetting_counters_are_read_at_scrape_time() -> None:
    stats = VettingStats()
    metrics = TransferMetrics(Role.PREFILL)
    metrics.attach_vetting(lambda: stats)
    stats.starts, stats.vetted, stats.refused, stats.deaths, stats.remembered = 2, 7, 1, 1, 3
    lines = {line for line in generate_latest(metrics.registry).decode().splitlines()
             if line.startswith("pd_transfer_metadata_vet")}
    assert lines == {
        "pd_transfer_metadata_vetters_started_total 2.0",
        'pd_transfer_metadata_vetted_total{outcome="loaded"} 7.0',
        'pd_transfer_metadata_vetted_total{outcome="refused"} 1.0',
        'pd_transfer_metadata_vetted_total{outcome="condemned"} 1.0',
        'pd_transfer_metadata_vetted_total{outcome="remembered"} 3.0',
    }
