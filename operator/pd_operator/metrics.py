"""Prometheus metrics of the operator, and the HTTP endpoint that serves them.

Names follow prometheus.io naming practice: a `pd_operator_` prefix, units in the name
(`_seconds`), `_total` on counters. They live in the process-wide default registry, so the
endpoint also serves the client library's process metrics (RSS, CPU, open fds).
`api_writes_total` counts every write request kube.py sends: a steady-state operator keeps it
flat, which is how tests and the benchmark prove that an idle reconcile writes nothing.
`transfer_reports_total`, `status_writes_total` and `status_writes_coalesced_total` show the
fan-in of the pods' TransferAgent reports: many reports, few status writes.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

__all__ = [
    "API_WRITES",
    "ENGINE_INSTANCES_CREATED",
    "ENGINE_ROLLOUTS",
    "ENGINE_ROLLOUT_DELETIONS",
    "ENGINE_ROLLOUT_PHASE",
    "LEADER",
    "LEADER_TRANSITIONS",
    "MANAGED_OBJECTS",
    "RECONCILES",
    "RECONCILE_DURATION",
    "STATUS_WRITES",
    "STATUS_WRITES_COALESCED",
    "TRANSFER_REPORTS",
    "WORKQUEUE_DEPTH",
    "api_writes_total",
    "serve",
]

RECONCILES: Final = Counter(
    "pd_operator_reconciles_total",
    "Reconciles of PDDeployments by result (success, error, conflict, invalid).",
    ["result"],
)
RECONCILE_DURATION: Final = Histogram(
    "pd_operator_reconcile_duration_seconds",
    "Wall time of one reconcile, from reading the PDDeployment to writing its status.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
API_WRITES: Final = Counter(
    "pd_operator_api_writes_total",
    "Write requests (POST, PUT, PATCH, DELETE) sent to the API server, by verb and kind.",
    ["verb", "kind"],
)
MANAGED_OBJECTS: Final = Gauge(
    "pd_operator_managed_objects",
    "Objects the operator manages, by kind, as of the last reconcile of each PDDeployment.",
    ["kind"],
)
# client-go's `leader_election_master_status`, with our prefix: 1 on the replica that holds
# the Lease, 0 on standbys; a replica without leader election reports nothing.
LEADER: Final = Gauge(
    "pd_operator_leader_election_master_status",
    "1 while this replica holds the leader Lease (namespace/name) and may write, else 0.",
    ["name"],
)
LEADER_TRANSITIONS: Final = Counter(
    "pd_operator_leader_election_acquired_total",
    "Times this replica took the leader Lease (namespace/name).",
    ["name"],
)
WORKQUEUE_DEPTH: Final = Gauge(
    "pd_operator_workqueue_depth",
    "PDDeployments waiting for a reconcile (not counting delayed retries and resyncs).",
)

TRANSFER_REPORTS: Final = Counter(
    "pd_operator_transfer_reports_total",
    "TransferAgent watch events received (each is one agent status write, or a create).",
)
STATUS_WRITES: Final = Counter(
    "pd_operator_status_writes_total",
    "Status writes sent: PDDeployment status (kind=PDDeployment) and the pods' transfer-ready "
    "readiness-gate condition (kind=Pod).",
    ["kind"],
)
STATUS_WRITES_COALESCED: Final = Counter(
    "pd_operator_status_writes_coalesced_total",
    "Status-only triggers (agent reports, the operator's own status writes) folded into a "
    "reconcile that was already due, so that they cause no status write of their own.",
)

ENGINE_ROLLOUTS: Final = Counter(
    "pd_operator_engine_rollouts_total",
    "Engine pod-template rollouts that ended, by result (complete, failed: rolled back).",
    ["result"],
)
ENGINE_ROLLOUT_DELETIONS: Final = Counter(
    "pd_operator_engine_rollout_pod_deletions_total",
    "Engine instances the operator deleted: old revisions in a rollout, the cheapest on a "
    "scale-down, failed pods (each drains before it stops).",
    ["role"],
)
ENGINE_INSTANCES_CREATED: Final = Counter(
    "pd_operator_engine_instances_created_total",
    "Engine instances (pods) the operator created: scale-ups, rollouts, replacements.",
    ["role"],
)
ENGINE_ROLLOUT_PHASE: Final = Gauge(
    "pd_operator_engine_rollout_phase",
    "1 for the phase each PDDeployment's engine rollout is in (status.rollout.phase).",
    ["namespace", "name", "phase"],
)

for _kind in ("PDDeployment", "Pod"):
    STATUS_WRITES.labels(kind=_kind)
for _result in ("success", "error", "conflict", "invalid"):
    RECONCILES.labels(result=_result)  # export zeros, so rates work from the first scrape
for _result in ("complete", "failed"):
    ENGINE_ROLLOUTS.labels(result=_result)
for _role in ("prefill", "decode"):
    ENGINE_ROLLOUT_DELETIONS.labels(role=_role)
    ENGINE_INSTANCES_CREATED.labels(role=_role)


def api_writes_total() -> float:
    """Sum of `pd_operator_api_writes_total` over all verbs and kinds in this process."""
    total = 0.0
    for metric in REGISTRY.collect():
        if metric.name == "pd_operator_api_writes":
            total += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return total


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics on `port` from a daemon thread; port 0 means do not serve."""
    if port:
        start_http_server(port, addr=addr)
