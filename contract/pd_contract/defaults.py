"""Defaults both sides fall back on: the CRD's defaults and the in-pod module's must agree."""

from __future__ import annotations

from typing import Final

__all__ = [
    "BOOTSTRAP_SECONDS",
    "GRANT_SECONDS",
    "KV_LEASE_SECONDS",
    "TRANSFER_BOOTSTRAP_PORT",
    "TRANSFER_METRICS_PORT",
    "TRANSFER_SECONDS",
]

# Deadlines of the transfer protocol (`spec.transfer.timeouts`, `TimeoutsConfig`, and the
# in-pod `Timeouts` a process uses when it is given no config).
BOOTSTRAP_SECONDS: Final = 30.0
GRANT_SECONDS: Final = 10.0
TRANSFER_SECONDS: Final = 60.0
KV_LEASE_SECONDS: Final = 120.0

# Port of the transfer module's Prometheus endpoint in every engine pod.
TRANSFER_METRICS_PORT: Final = 9400
# pd_transfer's bootstrap server of TP rank r listens on this port + r.
TRANSFER_BOOTSTRAP_PORT: Final = 8998
