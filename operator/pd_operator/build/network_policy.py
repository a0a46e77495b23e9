"""NetworkPolicies of a PDDeployment: who may open connections to its engine and router pods.

Without them every pod of the cluster reaches the engines' HTTP, KV-bootstrap (vLLM: side
channel) and metrics ports. With them an engine pod admits:
- every port from the PDDeployment's own pods (its peers and its router): NIXL over UCX/TCP
  connects on ports chosen at run time, so no port list can be given;
- the HTTP and transfer-metrics ports from the configured metrics scraper (the engines serve
  /metrics on their HTTP port);
- the HTTP port from the configured `httpClients`.
The router admits its serving port from anywhere: it is the PDDeployment's front door.

Labels are not authentication (any pod in the namespace may carry the deployment label):
peers still prove membership with the transfer key (docs/failure-modes.md #26). RDMA traffic
on secondary (Multus) interfaces is outside what a NetworkPolicy governs.
"""

from __future__ import annotations

from typing import Any

from pd_contract.defaults import TRANSFER_METRICS_PORT
from pd_contract.transferagent import Role
from pd_operator.api.network_spec import PeerSelector
from pd_operator.api.resources import PDDeployment
from pd_operator.build.meta import Manifest, object_meta
from pd_operator.build.names import (
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
    role_selector,
    role_workload,
    router_name,
    router_selector,
)

__all__ = ["build_network_policies"]


def _tcp(port: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port}


def _peer(selector: PeerSelector) -> dict[str, Any]:
    """One `from` entry; both selectors in one entry means a pod must match both."""
    return {
        "namespaceSelector": {"matchLabels": dict(selector.namespace_labels)},
        "podSelector": {"matchLabels": dict(selector.pod_labels)},
    }


def _policy(pdd: PDDeployment, name: str, component: str, *, pods: dict[str, str],
            ingress: list[dict[str, Any]], extra_labels: dict[str, str]) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(pdd, name, component, extra_labels),
        "spec": {
            "podSelector": {"matchLabels": pods},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def build_engine_network_policy(pdd: PDDeployment, role: Role) -> Manifest:
    """Ingress to one role's engine pods; named like the role's StatefulSet."""
    name = pdd.metadata.name
    policy = pdd.spec.network.policy
    http = pdd.spec.engine.port
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: name}}}]},
        {"from": [_peer(policy.metrics_scraper)],
         "ports": [_tcp(http), _tcp(TRANSFER_METRICS_PORT)]},
    ]
    if policy.http_clients:
        ingress.append({"from": [_peer(c) for c in policy.http_clients], "ports": [_tcp(http)]})
    return _policy(pdd, role_workload(name, role), role.value,
                   pods=role_selector(name, role), ingress=ingress,
                   extra_labels={LABEL_ROLE: role.value})


def build_router_network_policy(pdd: PDDeployment) -> Manifest:
    """Ingress to the router pods: its serving port from anywhere (no `from`)."""
    name = pdd.metadata.name
    ingress = [{"ports": [_tcp(pdd.spec.router.port)]}]
    return _policy(pdd, router_name(name), "router", pods=router_selector(name),
                   ingress=ingress, extra_labels={})


def build_network_policies(pdd: PDDeployment) -> list[Manifest]:
    """One per role, plus the router's when it is enabled; none when policies are off."""
    if not pdd.spec.network.policy.enabled:
        return []
    policies = [build_engine_network_policy(pdd, role) for role in (Role.PREFILL, Role.DECODE)]
    if pdd.spec.router.enabled:
        policies.append(build_router_network_policy(pdd))
    return policies
