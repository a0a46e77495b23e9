"""Labels, annotations, pod condition, env vars and paths both sides must spell alike.

The operator's builders write these into the pods and their TransferAgents; the in-pod agent
reads or writes the same keys. A key changed here changes on both sides at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

__all__ = [
    "AGENT_MANAGER",
    "DOWNWARD_API_ENV",
    "ENV_DATA_PARALLEL",
    "ENV_DEPLOYMENT",
    "ENV_NODE_NAME",
    "ENV_PEER_SERVICE",
    "ENV_PIPELINE_PARALLEL",
    "ENV_POD_IP",
    "ENV_POD_NAME",
    "ENV_POD_NAMESPACE",
    "ENV_POD_UID",
    "ENV_ROLE",
    "ENV_TENSOR_PARALLEL",
    "ENV_TRANSFER_AUTH_KEY_FILE",
    "ENV_TRANSFER_CONFIG",
    "ENV_TRANSFER_IDENTITY_FILE",
    "ENV_TRANSFER_METRICS_PORT",
    "LABEL_DEPLOYMENT",
    "LABEL_ENGINE_INSTANCE",
    "LABEL_KV_COMPAT",
    "LABEL_MANAGED_BY",
    "LABEL_ROLE",
    "TRANSFER_AUTH_KEY",
    "TRANSFER_AUTH_MOUNT",
    "TRANSFER_AUTH_PATH",
    "TRANSFER_CONFIG_KEY",
    "TRANSFER_CONFIG_MOUNT",
    "TRANSFER_CONFIG_PATH",
    "TRANSFER_IDENTITY_KEY",
    "TRANSFER_IDENTITY_MOUNT",
    "TRANSFER_IDENTITY_PATH",
    "TRANSFER_READY_CONDITION",
]

LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_DEPLOYMENT: Final = "pd.serving.dev/deployment"
LABEL_ROLE: Final = "pd.serving.dev/role"
# The engine instance a pod belongs to: its identity, the same across the pod's replacements
# (operator/pd_operator/engine_rollout/pods.py names it).
LABEL_ENGINE_INSTANCE: Final = "pd.serving.dev/instance"
# An engine pod's KV-compatibility key: a router pairs a prefill only with a decode whose
# key is the same (the operator's build/compat.py derives it).
LABEL_KV_COMPAT: Final = "pd.serving.dev/kv-compat"

# `app.kubernetes.io/managed-by` of the TransferAgents the in-pod agents create.
AGENT_MANAGER: Final = "pd-transfer-agent"

# Pod condition the operator sets from the pod's TransferAgent health (a readiness gate).
TRANSFER_READY_CONDITION: Final = "pd.serving.dev/transfer-ready"

# The transfer config document (`config.py`) reaches the pods as this file of a ConfigMap.
TRANSFER_CONFIG_KEY: Final = "transfer.json"
TRANSFER_CONFIG_MOUNT: Final = "/etc/pd-transfer"
TRANSFER_CONFIG_PATH: Final = f"{TRANSFER_CONFIG_MOUNT}/{TRANSFER_CONFIG_KEY}"

# The per-PDDeployment transfer key (a Secret) reaches the pods as this file; peers prove
# with it that they belong to the same PDDeployment. The file holds the key in force and,
# during a rotation, the previous one (see pd_transfer's auth module for the format).
TRANSFER_AUTH_KEY: Final = "transfer.key"
TRANSFER_AUTH_MOUNT: Final = "/var/run/pd-transfer/auth"
TRANSFER_AUTH_PATH: Final = f"{TRANSFER_AUTH_MOUNT}/{TRANSFER_AUTH_KEY}"
ENV_TRANSFER_AUTH_KEY_FILE: Final = "PD_TRANSFER_AUTH_KEY_FILE"
# This pod's identity file (pd_contract.identity), where the pod was given one; unset: the
# pod proves only that it holds the deployment's transfer key.
ENV_TRANSFER_IDENTITY_FILE: Final = "PD_TRANSFER_IDENTITY_FILE"
TRANSFER_IDENTITY_KEY: Final = "identity.json"
TRANSFER_IDENTITY_MOUNT: Final = "/var/run/pd-transfer/identity"
TRANSFER_IDENTITY_PATH: Final = f"{TRANSFER_IDENTITY_MOUNT}/{TRANSFER_IDENTITY_KEY}"

# The pod's identity, set through the downward API.
ENV_POD_NAME: Final = "POD_NAME"
ENV_POD_NAMESPACE: Final = "POD_NAMESPACE"
ENV_POD_UID: Final = "POD_UID"
ENV_POD_IP: Final = "POD_IP"
ENV_NODE_NAME: Final = "NODE_NAME"

# Variable → downward API fieldPath, in the order the pod template lists them.
DOWNWARD_API_ENV: Final[Mapping[str, str]] = MappingProxyType({
    ENV_POD_NAME: "metadata.name",
    ENV_POD_NAMESPACE: "metadata.namespace",
    ENV_POD_UID: "metadata.uid",
    ENV_POD_IP: "status.podIP",
    ENV_NODE_NAME: "spec.nodeName",
})

# The deployment's facts, set as plain values.
ENV_DEPLOYMENT: Final = "PD_DEPLOYMENT"
ENV_ROLE: Final = "PD_ROLE"
ENV_TENSOR_PARALLEL: Final = "PD_TENSOR_PARALLEL"
ENV_PIPELINE_PARALLEL: Final = "PD_PIPELINE_PARALLEL"
ENV_DATA_PARALLEL: Final = "PD_DATA_PARALLEL"
ENV_PEER_SERVICE: Final = "PD_PEER_SERVICE"
ENV_TRANSFER_CONFIG: Final = "PD_TRANSFER_CONFIG"
ENV_TRANSFER_METRICS_PORT: Final = "PD_TRANSFER_METRICS_PORT"
