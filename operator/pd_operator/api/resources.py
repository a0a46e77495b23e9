"""The two custom resources as whole objects, and how to parse them from API bodies.

Parsing is where the cross-field rules run (`parse_spec`, `parse_pdd`): the models check
fields, `rules.violations` checks how they fit together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pd_contract.api import API_VERSION, TRANSFERAGENT_KIND, TRANSFERAGENT_PLURAL, APIModel
from pd_contract.transferagent import TransferAgentSpec, TransferAgentStatus
from pd_operator.api.rules import violations
from pd_operator.api.spec import PDDeploymentSpec
from pd_operator.api.status import PDDeploymentStatus


class ObjectMeta(BaseModel):
    """The parts of metadata the operator reads; everything else is kept as is."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = ""
    namespace: str = ""
    uid: str = ""
    generation: int = 0
    resource_version: str = Field(default="", alias="resourceVersion")
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class CustomResource(APIModel):
    """Fields common to both kinds; subclasses fix kind, plural and schema."""

    kind_name: ClassVar[str]
    plural: ClassVar[str]
    singular: ClassVar[str]
    short_names: ClassVar[tuple[str, ...]]

    api_version: Literal["pd.serving.dev/v1alpha1"] = Field(
        default="pd.serving.dev/v1alpha1", description=API_VERSION
    )
    metadata: ObjectMeta = Field(default_factory=ObjectMeta, description="Object metadata.")


class PDDeployment(CustomResource):
    """A prefill/decode disaggregated serving deployment of one model."""

    kind_name: ClassVar[str] = "PDDeployment"
    plural: ClassVar[str] = "pddeployments"
    singular: ClassVar[str] = "pddeployment"
    short_names: ClassVar[tuple[str, ...]] = ("pdd",)

    kind: Literal["PDDeployment"] = Field(default="PDDeployment", description="PDDeployment")
    spec: PDDeploymentSpec = Field(description="Desired state.")
    status: PDDeploymentStatus | None = Field(default=None, description="Observed state.")


class TransferAgent(CustomResource):
    """The KV-transfer module of one engine pod: desired settings and reported state."""

    kind_name: ClassVar[str] = TRANSFERAGENT_KIND
    plural: ClassVar[str] = TRANSFERAGENT_PLURAL
    singular: ClassVar[str] = "transferagent"
    short_names: ClassVar[tuple[str, ...]] = ("pdta",)

    kind: Literal["TransferAgent"] = Field(default="TransferAgent", description="TransferAgent")
    spec: TransferAgentSpec = Field(description="Desired transfer settings of the pod.")
    status: TransferAgentStatus | None = Field(default=None, description="Reported state.")


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming the field by its wire path (e.g. spec.decode.replicas)."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"])
        if prefix and path:
            path = f"{prefix}.{path}"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling"
        lines.append(f"{path}: {msg}" if path else msg)
    return "; ".join(lines)


def _check_rules(spec: PDDeploymentSpec, given: Any) -> PDDeploymentSpec:
    """`spec`, or a ValidationError carrying every broken cross-field rule in one message
    (no location: each message names its fields), as a model validator would raise it."""
    problems = violations(spec)
    if not problems:
        return spec
    raise ValidationError.from_exception_data(PDDeploymentSpec.__name__, [{
        "type": "value_error", "loc": (), "input": given,
        "ctx": {"error": ValueError("; ".join(problems))},
    }])


def parse_spec(body: Mapping[str, Any]) -> PDDeploymentSpec:
    """Parse a PDDeployment body's spec and check its cross-field rules; raises
    ValidationError with wire-named locations."""
    given = body.get("spec") or {}
    return _check_rules(PDDeploymentSpec.model_validate(given), given)


def parse_pdd(body: Mapping[str, Any]) -> PDDeployment:
    """Parse a whole PDDeployment body (spec, status, metadata) and check its cross-field
    rules; raises ValidationError."""
    pdd = PDDeployment.model_validate(body)
    _check_rules(pdd.spec, body.get("spec"))
    return pdd
