"""The children of a PDDeployment that are applied whole, in apply order. The engine
instances (pods) and their templates' records are created one by one by the engine rollout
(`engine_rollout`, `build.instances`), never applied."""

from __future__ import annotations

from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.build.capabilities import Capabilities
from pd_operator.build.config import build_transfer_configmap
from pd_operator.build.meta import Manifest, desired_hash, stamp
from pd_operator.build.network import build_headless_service
from pd_operator.build.network_policy import build_network_policies
from pd_operator.build.rbac import build_role, build_role_binding, build_service_account
from pd_operator.build.router import (
    build_router_deployment,
    build_router_disruption_budget,
    build_router_rbac,
    build_router_service,
)
from pd_operator.build.workloads import build_pod_disruption_budget

__all__ = ["build_children", "child_key", "desired_hash"]


def build_children(pdd: PDDeployment, capabilities: Capabilities) -> list[Manifest]:
    """Every applied child the PDDeployment should have, identity and config first."""
    children: list[Manifest] = [
        build_service_account(pdd),
        build_role(pdd),
        build_role_binding(pdd),
        build_transfer_configmap(pdd),
    ]
    for role in (Role.PREFILL, Role.DECODE):
        children.append(build_headless_service(pdd, role))
    # Before the workloads, so no engine pod starts reachable by every pod of the cluster.
    children += build_network_policies(pdd)
    if capabilities.pod_disruption_budgets:
        for role in (Role.PREFILL, Role.DECODE):
            children.append(build_pod_disruption_budget(pdd, role))
    if pdd.spec.router.enabled:
        children += build_router_rbac(pdd)
        children.append(build_router_deployment(pdd))
        children.append(build_router_service(pdd))
        budget = build_router_disruption_budget(pdd)
        if budget is not None and capabilities.pod_disruption_budgets:
            children.append(budget)
    return [stamp(child) for child in children]


def child_key(manifest: Manifest) -> tuple[str, str, str, str]:
    """Identity of a child: (apiVersion, kind, namespace, name)."""
    meta = manifest["metadata"]
    return (manifest["apiVersion"], manifest["kind"], meta.get("namespace", ""), meta["name"])
