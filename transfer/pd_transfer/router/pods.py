"""Which pods of a PDDeployment are endpoints (pure: pod objects in, endpoints out).

An engine pod is an endpoint while it has a ``status.podIP``, its ``Ready`` condition is
``True`` (for pd_transfer pods that includes the transfer readiness gate) and it carries
no ``deletionTimestamp`` (a terminating pod leaves at once, before its readiness drops).
Its engine is ``http://<podIP>:<engine port>``, its bootstrap ``<podIP>:<bootstrap port>``,
its KV-compatibility key the pod's ``pd.serving.dev/kv-compat`` label.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pd_contract.names import LABEL_DEPLOYMENT, LABEL_KV_COMPAT, LABEL_ROLE
from pd_contract.transferagent import Role
from pd_transfer.router.endpoints import Endpoint

__all__ = ["EnginePorts", "is_ready", "pod_endpoint", "pod_selector"]


@dataclass(frozen=True)
class EnginePorts:
    engine: int
    bootstrap: int | None  # None: the protocol needs no bootstrap address (vllm-nixl)


def pod_selector(deployment: str) -> str:
    """The label selector of a PDDeployment's prefill and decode pods."""
    roles = ",".join(role.value for role in Role)
    return f"{LABEL_DEPLOYMENT}={deployment},{LABEL_ROLE} in ({roles})"


def is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
               if isinstance(c, dict))


def pod_endpoint(pod: Mapping[str, Any], ports: EnginePorts) -> Endpoint | None:
    """The pod's endpoint, or None while it is not one."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    role = next((r for r in Role if r.value == labels.get(LABEL_ROLE)), None)
    if role is None:
        return None
    ip = (pod.get("status") or {}).get("podIP")
    if meta.get("deletionTimestamp") or not ip or not is_ready(pod):
        return None
    bootstrap = None
    if ports.bootstrap is not None:
        bootstrap = f"{ip}:{ports.bootstrap}"
    compat = labels.get(LABEL_KV_COMPAT)
    return Endpoint(role, ip, ports.engine, bootstrap, pod=meta.get("name"),
                    compat=compat if isinstance(compat, str) else None)
