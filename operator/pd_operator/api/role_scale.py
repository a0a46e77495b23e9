"""`PDRole`: one role of a PDDeployment as a scale target.

The operator keeps one per role (`<deployment>-prefill`, `<deployment>-decode`), owned by
the PDDeployment. Its `/scale` subresource is what `kubectl scale`, a
HorizontalPodAutoscaler or a KEDA ScaledObject moves; the operator carries the count into
the PDDeployment's `spec.<role>.replicas`, which stays the one value the workloads are
built from.

Which value wins: the edit the operator has not carried over yet. A change of `spec.replicas`
here by someone else (`kubectl scale`, an HPA or KEDA through `/scale`, `kubectl edit`) is
written into the PDDeployment; otherwise the PDDeployment's count is copied here. When both
changed before the operator saw either, this object's count wins: an autoscaler asserts its
count again at every sync anyway, as it does over a Deployment it scales. A count the
operator wrote here itself (at creation, or copied from the PDDeployment) is never an edit,
whether or not it was acknowledged before the operator restarted: each such write records
the count in the annotation `pd.serving.dev/operator-replicas`, which `/scale` cannot
change, and a `spec.replicas` that differs from it is someone else's. An object without the
annotation (from a release before it) counts as edited while its `metadata.generation` is
past `status.observedGeneration`. `status.deploymentReplicas` shows the PDDeployment's count
beside `spec.replicas`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from pd_contract.api import APIModel
from pd_contract.transferagent import Role
from pd_operator.api.resources import CustomResource
from pd_operator.api.spec import MAX_ROLE_REPLICAS

__all__ = ["PDRole", "PDRoleSpec", "PDRoleStatus"]


class PDRoleSpec(APIModel):
    """Which role of which PDDeployment, and how many pods it should have."""

    pd_deployment: str = Field(
        min_length=1, max_length=253,
        description="The PDDeployment (same namespace) whose role this object scales.")
    role: Role = Field(description="prefill or decode.")
    replicas: int = Field(
        ge=0, le=MAX_ROLE_REPLICAS,
        description="Engine pods of the role; the operator writes it into the "
                    "PDDeployment's spec.<role>.replicas.")


class PDRoleStatus(APIModel):
    """The role as the operator last saw it."""

    replicas: int = Field(default=0, ge=0, description="Pods that exist for the role.")
    ready_replicas: int = Field(
        default=0, ge=0, description="Pods of the current revision that are Ready.")
    selector: str = Field(
        default="", description="Label selector of the role's pods (for the scale subresource).")
    deployment_replicas: int = Field(
        default=0, ge=0, description="The PDDeployment's spec.<role>.replicas.")
    observed_generation: int = Field(
        default=0, ge=0,
        description="The generation of this object whose spec.replicas the PDDeployment has.")
    message: str = Field(default="", description="Where the count came from last.")


class PDRole(CustomResource):
    """One role (prefill or decode) of a PDDeployment, with a /scale subresource."""

    kind_name: ClassVar[str] = "PDRole"
    plural: ClassVar[str] = "pdroles"
    singular: ClassVar[str] = "pdrole"
    short_names: ClassVar[tuple[str, ...]] = ("pdr",)

    kind: Literal["PDRole"] = Field(default="PDRole", description="PDRole")
    spec: PDRoleSpec = Field(description="The role and its desired pod count.")
    status: PDRoleStatus | None = Field(default=None, description="Observed state.")
