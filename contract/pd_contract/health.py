"""Which transfer failures count against a pod's own health: the in-pod agent (its
`healthy`) and the operator (the pod's readiness gate) judge alike from the same list.

A failure whose cause is the other side going away says nothing about the pod that reports
it: the peer process died (`PeerUnreachable`), no decode claimed the KV before its lease
ended (`LeaseExpired`), the prefill pod could not be found (`BootstrapTimeout`; SGLang's
`BootstrapFailed` as its sidecar reports it), or the peer gave up on the request
(`AbortedByPeer`, e.g. its client left). Counting them would take a
healthy pod out of service whenever a peer dies: a prefill whose decode was killed mid-
transfer would be gated out next, and with it every request. They still count in the
totals, the failures by reason and the deployment's TransferHealthy message; the dead peer
is gated out by its own report going stale.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

__all__ = ["PEER_CAUSED_FAILURES", "own_failures", "within_failure_ratio"]

PEER_CAUSED_FAILURES: Final = frozenset(
    {"PeerUnreachable", "LeaseExpired", "BootstrapTimeout", "BootstrapFailed",
     "AbortedByPeer"})


def own_failures(failures: int, failures_by_reason: Mapping[str, int]) -> int:
    """The failures of `failures` not caused by a peer going away."""
    peer = sum(n for reason, n in failures_by_reason.items() if reason in PEER_CAUSED_FAILURES)
    return max(0, failures - peer)


def within_failure_ratio(failures: int, failures_by_reason: Mapping[str, int],
                         transfers: int, max_failure_ratio: float) -> bool:
    """Whether the pod's own failures stay within `max_failure_ratio` of `transfers` (no
    traffic: nothing failed, healthy)."""
    return own_failures(failures, failures_by_reason) <= max_failure_ratio * transfers
