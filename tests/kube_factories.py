"""Small factories for Kubernetes objects as the API server returns them (plain dicts)."""

from __future__ import annotations

from typing import Any

from pd_operator.build.names import LABEL_DEPLOYMENT, LABEL_ROLE, LABEL_TEMPLATE_HASH

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
) -> Obj:
    """A pod of `deployment`'s `role`; `ready` sets its Ready condition to True."""
    metadata: Obj = {
        "name": name,
        "namespace": namespace,
        "labels": {LABEL_DEPLOYMENT: deployment, LABEL_ROLE: role,
                   LABEL_TEMPLATE_HASH: template_hash},
    }
    if deleting:
        metadata["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
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
