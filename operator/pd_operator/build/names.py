"""Names, labels and selectors of the objects a PDDeployment owns.

Every child carries `app.kubernetes.io/managed-by: pd-operator` (what the operator watches)
and `pd.serving.dev/deployment: <name>` (which PDDeployment it belongs to); role workloads
also carry `pd.serving.dev/role`. Selectors use only labels that never change for the life
of a workload, because a StatefulSet's selector is immutable.
"""

from __future__ import annotations

from typing import Final

from pd_operator.api.transferagent import Role

MANAGER: Final = "pd-operator"
FIELD_MANAGER: Final = "pd-operator"

LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_PART_OF: Final = "app.kubernetes.io/part-of"
LABEL_DEPLOYMENT: Final = "pd.serving.dev/deployment"
LABEL_ROLE: Final = "pd.serving.dev/role"
LABEL_TEMPLATE_HASH: Final = "pd.serving.dev/template-hash"

ANNOTATION_DESIRED_HASH: Final = "pd.serving.dev/desired-hash"
ANNOTATION_TRANSFER_CONFIG_HASH: Final = "pd.serving.dev/transfer-config-hash"

# Pod condition the operator sets from the pod's TransferAgent health (a readiness gate).
TRANSFER_READY_CONDITION: Final = "pd.serving.dev/transfer-ready"

TRANSFER_CONFIG_KEY: Final = "transfer.json"
TRANSFER_CONFIG_MOUNT: Final = "/etc/pd-transfer"


def role_workload(name: str, role: Role) -> str:
    """StatefulSet (and headless Service) of a role: `<name>-prefill`, `<name>-decode`."""
    return f"{name}-{role.value}"


def router_name(name: str) -> str:
    return f"{name}-router"


def transfer_config_name(name: str) -> str:
    return f"{name}-transfer"


def agent_service_account(name: str) -> str:
    """ServiceAccount of the engine pods; its Role lets the in-pod agent report."""
    return f"{name}-transfer-agent"


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
