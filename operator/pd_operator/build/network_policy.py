"""NetworkPolicies of a PDDeployment: who may open connections to its engine and router pods.

Without them every pod of the cluster reaches the engines' HTTP, KV-bootstrap (vLLM: side
channel) and metrics ports. With them an engine pod admits, by port:
- HTTP from every pod carrying the deployment label (its router among them);
- the bootstrap ports, `bootstrap_port + rank` for each rank of the role with the most
  ranks, only from the PDDeployment's own engine pods: the deployment label AND the role
  label In [prefill, decode], the labels its StatefulSets put on their pods, in a bare
  podSelector (same namespace only). A pd_transfer rank serves its bootstrap document
  there (transport connection info, registered regions and their keys) and the pod agent's
  control routes; an engine's own connector (EngineNative) its side channel;
- every port from those same engine pods: NIXL over UCX/TCP listens on ports the kernel
  picks at run time (no UCX port range is pinned), so no port list can be given. This rule
  implies the bootstrap one, which is kept so the policy names those ports and so that
  narrowing this rule to a pinned range later cannot open them to anyone else;
- HTTP and transfer metrics from the configured metrics scraper (the engines serve
  /metrics on their HTTP port);
- HTTP from the configured `httpClients`.
The router admits its serving port from anywhere: it is the PDDeployment's front door.

The bootstrap ports are listed one by one rather than as an `endPort` range: `endPort`
exists only from Kubernetes 1.21 (GA in 1.25), and an API server without it refuses the
whole server-side apply ("field not declared in schema"); the test control plane is v1.20.

Labels are not authentication (any pod in the namespace may carry them): peers still prove
membership with the transfer key (docs/failure-modes.md #26). A policy does nothing without
a CNI that enforces it, and RDMA traffic (RoCE, InfiniBand, secondary Multus interfaces)
is handled by the NIC, not the kernel path the CNI filters: the policy never sees it.
"""

from __future__ import annotations

from typing import Any

from pd_contract.defaults import TRANSFER_METRICS_PORT
from pd_contract.transferagent import Role
from pd_operator.api.network_spec import PeerSelector
from pd_operator.api.resources import PDDeployment
from pd_operator.build.config import bootstrap_port
from pd_operator.build.meta import Manifest, object_meta
from pd_operator.build.names import (
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
    role_selector,
    role_workload,
    router_name,
    router_selector,
)
from pd_operator.engines.base import role_spec

__all__ = ["build_network_policies"]


def _tcp(port: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port}


def _peer(selector: PeerSelector) -> dict[str, Any]:
    """One `from` entry; both selectors in one entry means a pod must match both."""
    return {
        "namespaceSelector": {"matchLabels": dict(selector.namespace_labels)},
        "podSelector": {"matchLabels": dict(selector.pod_labels)},
    }


def _engine_pods(name: str) -> dict[str, Any]:
    """The label selector of every engine pod of PDDeployment `name`, both roles: the two
    labels of `role_selector`, the role one allowed either value."""
    return {
        "matchLabels": {LABEL_DEPLOYMENT: name},
        "matchExpressions": [{"key": LABEL_ROLE, "operator": "In",
                              "values": [Role.PREFILL.value, Role.DECODE.value]}],
    }


def _bootstrap_ports(pdd: PDDeployment) -> list[int]:
    """`bootstrap_port + rank` for every rank (tensor × pipeline) of the role with the most."""
    ranks = max(role_spec(pdd, role).parallelism.gpus for role in (Role.PREFILL, Role.DECODE))
    first = bootstrap_port(pdd)
    return list(range(first, first + ranks))


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
        {"from": [{"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: name}}}],
         "ports": [_tcp(http)]},
        {"from": [{"podSelector": _engine_pods(name)}],
         "ports": [_tcp(port) for port in _bootstrap_ports(pdd)]},
        {"from": [{"podSelector": _engine_pods(name)}]},
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
