"""Pod template of a role: the engine container plus identity, placement and volumes."""

from __future__ import annotations

import copy
import math
from typing import Any, Final

from pd_contract.names import (
    ENV_TRANSFER_AUTH_KEY_FILE,
    ENV_TRANSFER_IDENTITY_FILE,
    LABEL_KV_COMPAT,
    TRANSFER_AUTH_MOUNT,
    TRANSFER_AUTH_PATH,
    TRANSFER_IDENTITY_MOUNT,
    TRANSFER_IDENTITY_PATH,
)
from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.build.agent import build_agent_container, build_agent_token_volume
from pd_operator.build.capabilities import DEFAULT_AGENT_IMAGE
from pd_operator.build.compat import kv_compat_key
from pd_operator.build.config import transfer_config_hash
from pd_operator.build.engine import (
    ENGINE_CONTAINER,
    engine_command,
    engine_env,
    engine_ports,
    engine_probes,
    engine_resources,
)
from pd_operator.build.identity import IDENTITY_VOLUME
from pd_operator.build.meta import content_hash
from pd_operator.build.names import (
    ANNOTATION_TRANSFER_CONFIG_HASH,
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
    LABEL_TEMPLATE_HASH,
    TRANSFER_CONFIG_MOUNT,
    TRANSFER_READY_CONDITION,
    agent_service_account,
    base_labels,
    role_selector,
    role_workload,
    transfer_config_name,
    transfer_key_name,
)
from pd_operator.engines import engine_adapter, role_spec, runs_pd_transfer

MULTUS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
# Volcano reads the annotation, the scheduler-plugins coscheduling plugin the label.
GANG_ANNOTATION = "scheduling.k8s.io/group-name"
GANG_LABEL = "scheduling.x-k8s.io/pod-group"

# What GPU/RDMA serving needs and no more. IPC_LOCK lets the NIC driver pin (register) KV
# memory for RDMA; every other capability is dropped. The user is left to the image: the
# engine images (vLLM, SGLang, CUDA bases) run as root and write caches (Triton, torch
# compile, model downloads) into the root filesystem, so neither runAsNonRoot nor a
# read-only root is set; without capabilities, root cannot override file permissions.
# /dev/shm is a memory emptyDir (see _volumes): NCCL and the engines' worker processes
# share tensors through it.
# After its preStop hook, what an engine gets between SIGTERM and SIGKILL for its own
# shutdown; a decode's default drain: the longest generation left to finish.
_ENGINE_STOP_S: Final = 60
_DECODE_DRAIN_S: Final = 300

_ENGINE_SECURITY_CONTEXT: Final[dict[str, Any]] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
}


def _affinity(pdd: PDDeployment, role: Role) -> dict[str, Any] | None:
    """The user's affinity plus, when asked, co-location of all of the deployment's pods."""
    overlay = role_spec(pdd, role).pod.affinity
    affinity = copy.deepcopy(overlay) if overlay else {}
    placement = pdd.spec.placement
    if placement.colocation_topology_key:
        term = {
            "labelSelector": {"matchLabels": {LABEL_DEPLOYMENT: pdd.metadata.name}},
            "topologyKey": placement.colocation_topology_key,
        }
        pod_affinity = affinity.setdefault("podAffinity", {})
        if placement.required:
            pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
                term
            )
        else:
            pod_affinity.setdefault(
                "preferredDuringSchedulingIgnoredDuringExecution", []
            ).append({"weight": 100, "podAffinityTerm": term})
    return affinity or None


def _volumes(pdd: PDDeployment, role: Role) -> tuple[list[Any], list[Any]]:
    rs = role_spec(pdd, role)
    volumes: list[Any] = [
        {"name": "dshm",
         "emptyDir": {"medium": "Memory", "sizeLimit": f"{rs.shared_memory_gib}Gi"}},
        {"name": "transfer-config",
         "configMap": {"name": transfer_config_name(pdd.metadata.name)}},
    ]
    mounts: list[Any] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "transfer-config", "mountPath": TRANSFER_CONFIG_MOUNT, "readOnly": True},
    ]
    if runs_pd_transfer(pdd):
        # The whole directory, not a subPath: the kubelet then updates the file when the
        # key rotates (a subPath mount never is), and pd_transfer re-reads it. Readable by
        # the owner only.
        volumes.append({"name": "transfer-key",
                        "secret": {"secretName": transfer_key_name(pdd.metadata.name),
                                   "defaultMode": 0o400}})
        mounts.append({"name": "transfer-key", "mountPath": TRANSFER_AUTH_MOUNT,
                       "readOnly": True})
        # The instance's own identity (docs/failure-modes.md #59): its Secret is named after
        # the instance, so the volume is added per pod (build.instances), the mount here.
        mounts.append({"name": IDENTITY_VOLUME, "mountPath": TRANSFER_IDENTITY_MOUNT,
                       "readOnly": True})
    volumes += copy.deepcopy(rs.pod.volumes)
    mounts += copy.deepcopy(rs.pod.volume_mounts)
    return volumes, mounts


def _env(pdd: PDDeployment, role: Role) -> list[dict[str, Any]]:
    """The engine's environment, then where the transfer key and the pod's identity are:
    listed last, so a user variable of the same name cannot point pd_transfer elsewhere."""
    env = engine_env(pdd, role)
    if runs_pd_transfer(pdd):
        env.append({"name": ENV_TRANSFER_AUTH_KEY_FILE, "value": TRANSFER_AUTH_PATH})
        env.append({"name": ENV_TRANSFER_IDENTITY_FILE, "value": TRANSFER_IDENTITY_PATH})
    return env


def drain_seconds(pdd: PDDeployment, role: Role) -> int:
    """How long a leaving pod's preStop hook may wait for its work to end
    (`spec.<role>.drainSeconds`, or its default)."""
    given = role_spec(pdd, role).drain_seconds
    if given is not None:
        return given
    if role is Role.DECODE:
        return _DECODE_DRAIN_S
    timeouts = pdd.spec.transfer.timeouts
    return math.ceil(timeouts.transfer_seconds + timeouts.kv_lease_seconds)


def reports_transfer_health(pdd: PDDeployment) -> bool:
    """Whether the pods run pd_transfer's agent, which reports into a TransferAgent.

    Only then does the pod carry the transfer readiness gate: an engine that moves KV with
    its own connector never reports, and a gate nobody sets would keep its pods unready.
    """
    return engine_adapter(pdd).reports_transfer_health(pdd)


def build_pod_template(pdd: PDDeployment, role: Role,
                       agent_image: str = DEFAULT_AGENT_IMAGE) -> dict[str, Any]:
    """The pod template, labelled with the hash of everything that needs a pod restart.

    The staging pool sizes are not part of it: they reach running pods through their
    TransferAgents, so changing them never restarts an engine. An engine-native pod gets the
    transfer-agent sidecar (`build.agent`), from `agent_image`.
    """
    spec = pdd.spec
    rs = role_spec(pdd, role)
    name = pdd.metadata.name
    labels = base_labels(name, role.value) | role_selector(name, role) | dict(rs.pod.labels)
    labels[LABEL_KV_COMPAT] = kv_compat_key(pdd)
    annotations = dict(rs.pod.annotations)
    annotations[ANNOTATION_TRANSFER_CONFIG_HASH] = transfer_config_hash(pdd)
    rdma = spec.network.rdma
    if rdma.enabled and rdma.networks:
        annotations[MULTUS_ANNOTATION] = ",".join(rdma.networks)
    gang = spec.placement.gang
    if gang.enabled:
        annotations[GANG_ANNOTATION] = role_workload(name, role)
        labels[GANG_LABEL] = role_workload(name, role)

    volumes, mounts = _volumes(pdd, role)
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy.value,
        "command": engine_command(pdd, role),
        "env": _env(pdd, role),
        "ports": engine_ports(pdd),
        "resources": engine_resources(pdd, role),
        "volumeMounts": mounts,
        "securityContext": copy.deepcopy(_ENGINE_SECURITY_CONTEXT),
        **engine_probes(pdd),
    }
    drain_s = drain_seconds(pdd, role)
    hook = engine_adapter(pdd).drain_command(pdd, role, drain_s) if drain_s > 0 else None
    if hook is not None:
        container["lifecycle"] = {"preStop": {"exec": {"command": hook}}}
    native_agent = engine_adapter(pdd).runs_native_agent(pdd)
    containers = [container]
    if native_agent:
        containers.append(build_agent_container(pdd, role, agent_image))
        volumes.append(build_agent_token_volume())
    pod_spec: dict[str, Any] = {
        "serviceAccountName": agent_service_account(name),
        # Only the agent talks to the API server (it writes the pod's TransferAgent): with
        # pd_transfer it runs inside the engine, which then needs the token; the sidecar of
        # an engine-native pod gets its own (a projected volume), the engine none.
        "automountServiceAccountToken": runs_pd_transfer(pdd),
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": drain_s + _ENGINE_STOP_S if hook else _ENGINE_STOP_S,
        "containers": containers,
        "volumes": volumes,
    }
    if reports_transfer_health(pdd):
        pod_spec["readinessGates"] = [{"conditionType": TRANSFER_READY_CONDITION}]
    if rs.pod.node_selector:
        pod_spec["nodeSelector"] = dict(rs.pod.node_selector)
    if rs.pod.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in rs.pod.tolerations
        ]
    affinity = _affinity(pdd, role)
    if affinity:
        pod_spec["affinity"] = affinity
    if rs.pod.priority_class_name:
        pod_spec["priorityClassName"] = rs.pod.priority_class_name
    if rs.pod.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in rs.pod.image_pull_secrets]
    if gang.enabled:
        pod_spec["schedulerName"] = gang.scheduler_name

    template: dict[str, Any] = {
        "metadata": {"labels": labels, "annotations": annotations},
        "spec": pod_spec,
    }
    template["metadata"]["labels"][LABEL_TEMPLATE_HASH] = content_hash(template, length=10)
    return template


def template_hash(template: dict[str, Any]) -> str:
    return str(template["metadata"]["labels"][LABEL_TEMPLATE_HASH])


def role_of(labels: dict[str, str]) -> Role | None:
    value = labels.get(LABEL_ROLE)
    return Role(value) if value in {r.value for r in Role} else None
