"""Pieces of a pod that users may overlay on the generated workloads."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import Field

from pd_contract.api import APIModel

# Objects whose schema Kubernetes owns (affinity, volumes, ...) are passed through untouched;
# the CRD marks them x-kubernetes-preserve-unknown-fields and kubernetes-validate checks the
# workloads built from them against the real schema.
KubeObject = dict[str, Any]


class EnvVar(APIModel):
    """An environment variable for the engine container."""

    name: str = Field(min_length=1, description="Name of the environment variable.")
    value: str | None = Field(default=None, description="Literal value.")
    value_from: KubeObject | None = Field(
        default=None,
        description="Source of the value, as in a Pod's env[].valueFrom "
        "(secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef).",
    )


class TolerationOperator(StrEnum):
    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(StrEnum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(APIModel):
    """A toleration, as in a Pod spec."""

    key: str | None = Field(default=None, description="Taint key the toleration applies to.")
    operator: TolerationOperator | None = Field(
        default=None, description="Exists or Equal (Equal when omitted)."
    )
    value: str | None = Field(default=None, description="Taint value the toleration matches.")
    effect: TaintEffect | None = Field(
        default=None, description="Taint effect to match; all effects when omitted."
    )
    toleration_seconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated."
    )


class ContainerResources(APIModel):
    """CPU and memory for the engine container; GPUs and RDMA devices are added from the spec."""

    requests: dict[str, str] = Field(
        default_factory=dict,
        description="Resource requests, e.g. {cpu: '16', memory: 256Gi}. Do not list "
        "nvidia.com/gpu or the RDMA resource here: they come from gpusPerPod and network.rdma.",
    )
    limits: dict[str, str] = Field(
        default_factory=dict,
        description="Resource limits, e.g. {memory: 512Gi}. GPU and RDMA limits are added "
        "from the spec.",
    )


class PodOverlay(APIModel):
    """Fields merged into the generated pod template of one role."""

    labels: dict[str, str] = Field(
        default_factory=dict, description="Extra labels on the role's pods."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, description="Extra annotations on the role's pods."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the role's pods must run on."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations for the role's pods (e.g. GPU taints)."
    )
    affinity: KubeObject | None = Field(
        default=None,
        description="Pod affinity rules, as in a Pod spec. Merged with the placement rules "
        "the operator adds for co-location.",
    )
    priority_class_name: str | None = Field(
        default=None, description="PriorityClass of the role's pods."
    )
    volumes: list[KubeObject] = Field(
        default_factory=list, description="Extra volumes, as in a Pod spec (e.g. model cache)."
    )
    volume_mounts: list[KubeObject] = Field(
        default_factory=list, description="Extra volume mounts for the engine container."
    )
    env: list[EnvVar] = Field(
        default_factory=list, description="Extra environment variables for this role only."
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list, description="Names of Secrets used to pull the engine image."
    )
