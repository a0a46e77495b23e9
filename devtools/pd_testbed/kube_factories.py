"""Small factories for Kubernetes objects as the API server returns them (plain dicts)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from pd_operator.api import TransferAgent
from pd_operator.build.names import (
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    LABEL_ROLE,
    LABEL_TEMPLATE_HASH,
    TRANSFER_READY_CONDITION,
)

__all__ = ["Obj", "make_agent", "make_pod", "make_pods", "make_router_deployment"]

Obj = dict[str, Any]


def make_pod(
    name: str,
    *,
    role: str = "prefill",
    template_hash: str = "rev1",
    ready: bool = False,
    deployment: str = "llama",
    namespace: str = "default",
    deleting: bool = False,
    uid: str | None = None,
    gated: bool = False,
) -> Obj:
    """A pod of `deployment`'s `role`; `ready` sets its Ready condition to True; `uid`
    defaults to `uid-<name>`; `gated` declares the transfer readiness gate."""
    metadata: Obj = {
        "name": name,
        "namespace": namespace,
        "uid": uid or f"uid-{name}",
        "labels": {LABEL_DEPLOYMENT: deployment, LABEL_ROLE: role,
                   LABEL_TEMPLATE_HASH: template_hash},
    }
    if deleting:
        metadata["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"readinessGates": [{"conditionType": TRANSFER_READY_CONDITION}]}
        if gated else {},
        "status": {
            "phase": "Running" if ready else "Pending",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def make_pods(
    role: str, count: int, *, template_hash: str = "rev1", ready: int = 0,
    deployment: str = "llama",
) -> list[Obj]:
    """`count` pods named `<deployment>-<role>-<i>`, the first `ready` of them Ready."""
    return [
        make_pod(f"{deployment}-{role}-{i}", role=role, template_hash=template_hash,
                 ready=i < ready, deployment=deployment)
        for i in range(count)
    ]


def make_router_deployment(available: int, name: str = "llama-router") -> Obj:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default"},
        "status": {"availableReplicas": available},
    }


def make_agent(
    pod: str,
    *,
    report_time: datetime | None,
    role: str = "decode",
    deployment: str = "llama",
    namespace: str = "default",
    pod_uid: str | None = None,
    healthy: bool | None = True,
    window: tuple[int, int] = (0, 0),
    window_reasons: Mapping[str, int] | None = None,
    totals: tuple[int, int, int] = (0, 0, 0),
    failures_by_reason: Mapping[str, int] | None = None,
    staging_mib: tuple[int, int] = (4096, 2048),
    ring: Mapping[str, int] | None = None,
    transports: Sequence[tuple[str, str]] = (),
    resizing: bool = False,
    recent_failures: Sequence[Mapping[str, Any]] = (),
    live_requests: int = 0,
    pending_kv: tuple[int, int, float] = (0, 0, 0.0),
    last_error: str = "",
    agents: Sequence[str] = (),
    peers: Mapping[str, Sequence[str]] | None = None,
) -> Obj:
    """A TransferAgent body as the API server returns it, written by `pod`'s agent.

    `window` is (transfers, failures) in the last 60 s; `totals` is (bytes, transfers,
    failures) since start; `staging_mib` is (decodePoolMiB, prefillBufferMiB) in force;
    `ring` holds RingWatermark fields in wire (camelCase) form; `transports` is
    [(peer, transport)]; `agents` the pod's own NIXL agent names and `peers` {peer pod:
    [peer agent names held]}; `pending_kv` is (requests, bytes, oldest seconds). The status
    goes through the model, so a factory typo fails here.
    """
    uid = pod_uid or f"uid-{pod}"
    status: Obj = {
        "podUID": uid,
        "incarnation": f"{uid}/1",
        "staging": {"decodePoolMiB": staging_mib[0], "prefillBufferMiB": staging_mib[1]},
        "resizing": resizing,
        "ring": dict(ring or {}),
        "liveRequests": live_requests,
        "pendingKV": {"requests": pending_kv[0], "bytes": pending_kv[1],
                      "oldestSeconds": pending_kv[2]},
        "bytesTotal": totals[0],
        "transfersTotal": totals[1],
        "failuresTotal": totals[2],
        "failuresByReason": dict(failures_by_reason or {}),
        "window": {"seconds": 60, "transfers": window[0], "failures": window[1],
                   "failuresByReason": dict(window_reasons or {})},
        "recentFailures": [dict(f) for f in recent_failures],
        "transports": [{"peer": p, "transport": t} for p, t in transports],
        "lastError": last_error,
        "agents": list(agents),
        "peers": [{"pod": pod_name, "agents": list(names)}
                  for pod_name, names in (peers or {}).items()],
    }
    if healthy is not None:
        status["healthy"] = healthy
    if report_time is not None:
        status["reportTime"] = report_time.strftime("%Y-%m-%dT%H:%M:%SZ")
    body: Obj = {
        "apiVersion": "pd.serving.dev/v1alpha1",
        "kind": "TransferAgent",
        "metadata": {
            "name": pod, "namespace": namespace,
            "labels": {LABEL_DEPLOYMENT: deployment, LABEL_ROLE: role,
                       LABEL_MANAGED_BY: "pd-transfer-agent"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}],
        },
        "spec": {"pdDeployment": deployment, "role": role,
                 "staging": {"decodePoolMiB": staging_mib[0],
                             "prefillBufferMiB": staging_mib[1]}},
        "status": status,
    }
    return TransferAgent.model_validate(body).to_wire() | {"metadata": body["metadata"]}
