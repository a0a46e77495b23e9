"""StatefulSets (stable pod identities for bootstrap) and PodDisruptionBudgets per role."""

from __future__ import annotations

from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.api.rollout_spec import RolloutStrategy
from pd_operator.build.capabilities import DEFAULT_AGENT_IMAGE
from pd_operator.build.meta import Manifest, object_meta
from pd_operator.build.names import LABEL_ROLE, role_selector, role_workload
from pd_operator.build.pod import build_pod_template
from pd_operator.engines import role_spec


def build_statefulset(pdd: PDDeployment, role: Role,
                      agent_image: str = DEFAULT_AGENT_IMAGE) -> Manifest:
    name = pdd.metadata.name
    workload = role_workload(name, role)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": object_meta(pdd, workload, role.value, {LABEL_ROLE: role.value}),
        "spec": {
            "replicas": role_spec(pdd, role).replicas,
            "serviceName": workload,
            "selector": {"matchLabels": role_selector(name, role)},
            # Engines do not depend on each other's start order: start them all at once.
            "podManagementPolicy": "Parallel",
            # Surge and Recreate: the operator decides which pod goes when
            # (pd_operator.revisions); RollingUpdate: the StatefulSet controller does.
            "updateStrategy": {"type": "RollingUpdate" if pdd.spec.rollout.strategy
                               is RolloutStrategy.ROLLING_UPDATE else "OnDelete"},
            "template": build_pod_template(pdd, role, agent_image),
        },
    }


def build_pod_disruption_budget(pdd: PDDeployment, role: Role) -> Manifest:
    """At most one engine pod of a role is voluntarily evicted at a time."""
    name = pdd.metadata.name
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(pdd, role_workload(name, role), role.value,
                                {LABEL_ROLE: role.value}),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": role_selector(name, role)},
        },
    }
