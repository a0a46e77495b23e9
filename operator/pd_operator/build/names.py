"""Names, labels and selectors of the objects a PDDeployment owns.

Every child carries `app.kubernetes.io/managed-by: pd-operator` (what the operator watches)
and `pd.serving.dev/deployment: <name>` (which PDDeployment it belongs to); role workloads
also carry `pd.serving.dev/role`. Selectors use only labels that never change for the life
of a workload, because a StatefulSet's selector is immutable.
"""

from __future__ import annotations

from typing import Final

from pd_contract.names import (
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    LABEL_ROLE,
    TRANSFER_CONFIG_KEY,
    TRANSFER_CONFIG_MOUNT,
    TRANSFER_READY_CONDITION,
)
from pd_contract.transferagent import Role
from pd_operator.api.naming import (
    agent_service_account,
    role_workload,
    router_name,
    router_service_account,
    transfer_config_name,
    transfer_key_name,
)

# The names the in-pod side reads too come from `pd_contract.names`, and the names derived
# from the PDDeployment's name from `api.naming` (where their length limits are checked);
# re-exported here so the operator finds every name in one module.
__all__ = [
    "ANNOTATION_DESIRED_HASH",
    "ANNOTATION_OPERATOR_REPLICAS",
    "ANNOTATION_TRANSFER_CONFIG_HASH",
    "FIELD_MANAGER",
    "LABEL_COMPONENT",
    "LABEL_DEPLOYMENT",
    "LABEL_INSTANCE",
    "LABEL_MANAGED_BY",
    "LABEL_NAME",
    "LABEL_PART_OF",
    "LABEL_ROLE",
    "LABEL_TEMPLATE_HASH",
    "MANAGER",
    "TRANSFER_CONFIG_KEY",
    "TRANSFER_CONFIG_MOUNT",
    "TRANSFER_READY_CONDITION",
    "agent_service_account",
    "base_labels",
    "role_selector",
    "role_workload",
    "router_name",
    "router_selector",
    "router_service_account",
    "selector_string",
    "transfer_config_name",
    "transfer_key_name",
]

MANAGER: Final = "pd-operator"
FIELD_MANAGER: Final = "pd-operator"

LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_PART_OF: Final = "app.kubernetes.io/part-of"
LABEL_TEMPLATE_HASH: Final = "pd.serving.dev/template-hash"

ANNOTATION_DESIRED_HASH: Final = "pd.serving.dev/desired-hash"
ANNOTATION_TRANSFER_CONFIG_HASH: Final = "pd.serving.dev/transfer-config-hash"
# On a PDRole: the spec.replicas the operator last wrote or carried over (reconcile/role_scale).
ANNOTATION_OPERATOR_REPLICAS: Final = "pd.serving.dev/operator-replicas"


def base_labels(name: str, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: "pd-deployment",
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: component,
        LABEL_PART_OF: "pd-operator",
        LABEL_MANAGED_BY: MANAGER,
        LABEL_DEPLOYMENT: name,
    }


def role_selector(name: str, role: Role) -> dict[str, str]:
    """Immutable selector of a role's pods."""
    return {LABEL_DEPLOYMENT: name, LABEL_ROLE: role.value}


def router_selector(name: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: name, LABEL_COMPONENT: "router"}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
