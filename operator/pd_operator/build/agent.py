"""The transfer-agent sidecar of engine-native pods: `pd-transfer agent` reading the engine's
own KV-transfer metrics into the pod's TransferAgent.

Only this container talks to the API server, so only it gets a ServiceAccount token: a
projected volume at the path the Kubernetes clients read in-cluster credentials from (token,
CA bundle, namespace), while the pod's automatic token mount stays off and the engine
container has none. It runs from the operator's own image (no torch, no NIXL needed), as a
non-root user on a read-only root filesystem.
"""

from __future__ import annotations

from typing import Any, Final

from pd_contract.defaults import TRANSFER_METRICS_PORT
from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.build.engine import identity_env
from pd_operator.build.names import TRANSFER_CONFIG_MOUNT
from pd_operator.engines import engine_adapter

__all__ = [
    "AGENT_CONTAINER",
    "AGENT_TOKEN_VOLUME",
    "SERVICE_ACCOUNT_MOUNT",
    "build_agent_container",
    "build_agent_token_volume",
]

AGENT_CONTAINER: Final = "transfer-agent"
AGENT_TOKEN_VOLUME: Final = "transfer-agent-token"
# Where in-cluster Kubernetes clients look for the token, CA bundle and namespace.
SERVICE_ACCOUNT_MOUNT: Final = "/var/run/secrets/kubernetes.io/serviceaccount"
_TOKEN_SECONDS: Final = 3600  # the kubelet refreshes a projected token before it expires
_NONROOT: Final = 65532  # the operator image's user


def build_agent_container(pdd: PDDeployment, role: Role, image: str) -> dict[str, Any]:
    """The sidecar; the pod must carry `build_agent_token_volume()` and the transfer-config
    volume."""
    adapter = engine_adapter(pdd)
    engine = adapter.native_agent_engine
    if engine is None:
        raise ValueError(f"{adapter.framework.value} has no transfer-agent mapping")
    return {
        "name": AGENT_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "pd-transfer", "agent", "--engine", engine,
            # The engine serves Prometheus on its HTTP port; the pod shares one network.
            "--engine-metrics-url", f"http://127.0.0.1:{pdd.spec.engine.port}/metrics",
            "--engine-bootstrap-port", str(adapter.bootstrap_port(pdd)),
        ],
        "env": identity_env(pdd, role),
        "ports": [{"name": "kv-metrics", "containerPort": TRANSFER_METRICS_PORT,
                   "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"},
                      "limits": {"memory": "256Mi"}},
        # Its own metrics answer once it runs; a hung agent is restarted (its reports then
        # go stale and the pod's gate says so meanwhile).
        "readinessProbe": {"httpGet": {"path": "/metrics", "port": "kv-metrics"},
                           "periodSeconds": 10},
        "livenessProbe": {"httpGet": {"path": "/metrics", "port": "kv-metrics"},
                          "periodSeconds": 30, "failureThreshold": 3, "timeoutSeconds": 5},
        "volumeMounts": [
            {"name": "transfer-config", "mountPath": TRANSFER_CONFIG_MOUNT, "readOnly": True},
            {"name": AGENT_TOKEN_VOLUME, "mountPath": SERVICE_ACCOUNT_MOUNT, "readOnly": True},
        ],
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": _NONROOT, "runAsGroup": _NONROOT,
            "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def build_agent_token_volume() -> dict[str, Any]:
    """The sidecar's credentials, as the automatic token mount would give them to it alone."""
    return {
        "name": AGENT_TOKEN_VOLUME,
        "projected": {"sources": [
            {"serviceAccountToken": {"path": "token", "expirationSeconds": _TOKEN_SECONDS}},
            {"configMap": {"name": "kube-root-ca.crt",
                           "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace",
                                        "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
        ]},
    }
