"""PodDisruptionBudgets per role: at most one engine pod of a role evicted at a time."""

from __future__ import annotations

from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.build.meta import Manifest, object_meta
from pd_operator.build.names import LABEL_ROLE, role_selector, role_workload
from pd_operator.engines import role_spec


def build_pod_disruption_budget(pdd: PDDeployment, role: Role) -> Manifest:
    """At most one engine pod of a role is voluntarily evicted at a time.

    `minAvailable` is a count, not `maxUnavailable`: the disruption controller turns
    `maxUnavailable` into a count through the pods' controller's `/scale`, and the engine
    pods' controller is the PDDeployment, whose `/scale` is decode's. A count needs no
    controller; it follows `spec.<role>.replicas`."""
    name = pdd.metadata.name
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(pdd, role_workload(name, role), role.value,
                                {LABEL_ROLE: role.value}),
        "spec": {
            "minAvailable": max(0, role_spec(pdd, role).replicas - 1),
            "selector": {"matchLabels": role_selector(name, role)},
        },
    }
