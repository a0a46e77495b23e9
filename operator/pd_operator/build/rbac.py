"""Identity of the engine pods: a ServiceAccount whose Role lets the in-pod agent report.

Least privilege: the agent may create and update TransferAgents and their status in its own
namespace, and nothing else (it learns its own pod from the downward API, not the API).
"""

from __future__ import annotations

from pd_contract.api import GROUP, TRANSFERAGENT_PLURAL
from pd_operator.api.resources import PDDeployment
from pd_operator.build.meta import Manifest, object_meta
from pd_operator.build.names import agent_service_account

COMPONENT = "transfer-agent"


def build_service_account(pdd: PDDeployment) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": object_meta(pdd, agent_service_account(pdd.metadata.name), COMPONENT),
    }


def build_role(pdd: PDDeployment) -> Manifest:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": object_meta(pdd, agent_service_account(pdd.metadata.name), COMPONENT),
        "rules": [
            {
                "apiGroups": [GROUP],
                "resources": [TRANSFERAGENT_PLURAL],
                "verbs": ["get", "list", "watch", "create", "update", "patch"],
            },
            {
                "apiGroups": [GROUP],
                "resources": [f"{TRANSFERAGENT_PLURAL}/status"],
                "verbs": ["get", "update", "patch"],
            },
        ],
    }


def build_role_binding(pdd: PDDeployment) -> Manifest:
    name = agent_service_account(pdd.metadata.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": object_meta(pdd, name, COMPONENT),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [
            {"kind": "ServiceAccount", "name": name, "namespace": pdd.metadata.namespace}
        ],
    }
