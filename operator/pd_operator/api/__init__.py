"""The pd.serving.dev/v1alpha1 API: pydantic models are the single source of truth.

The TransferAgent models, the base model and the group/version live in `pd_contract` (the
pods write TransferAgents too) and are re-exported here.

The CRD schemas in crds/ are generated from these models (`pd-operator crds`), and the
operator parses every object through them.
"""

from pd_contract.api import API_VERSION, GROUP, VERSION, APIModel
from pd_contract.transferagent import Role, TransferAgentSpec, TransferAgentStatus
from pd_operator.api.conditions import Condition, ConditionStatus
from pd_operator.api.resources import (
    PDDeployment,
    TransferAgent,
    format_validation_error,
    parse_pdd,
    parse_spec,
)
from pd_operator.api.rules import RULES, CrossFieldRule, violations
from pd_operator.api.sizing import StagingFootprint, compute_staging_footprint, staging_in_use
from pd_operator.api.spec import (
    Attention,
    KVDtype,
    PDDeploymentSpec,
    StagingMode,
)
from pd_operator.api.status import (
    PDDeploymentStatus,
    Phase,
    RollbackReason,
    RolloutMode,
    RolloutPhase,
)

__all__ = [
    "API_VERSION",
    "GROUP",
    "RULES",
    "VERSION",
    "APIModel",
    "Attention",
    "Condition",
    "ConditionStatus",
    "CrossFieldRule",
    "KVDtype",
    "PDDeployment",
    "PDDeploymentSpec",
    "PDDeploymentStatus",
    "Phase",
    "Role",
    "RollbackReason",
    "RolloutMode",
    "RolloutPhase",
    "StagingFootprint",
    "StagingMode",
    "TransferAgent",
    "TransferAgentSpec",
    "TransferAgentStatus",
    "compute_staging_footprint",
    "format_validation_error",
    "parse_pdd",
    "parse_spec",
    "staging_in_use",
    "violations",
]
