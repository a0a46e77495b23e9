"""Status of a PDDeployment, computed as data: conditions and their reasons (`conditions`),
and the aggregation of observed pods and children into `PDDeploymentStatus` (`compute`).

Reading order: `conditions` (types, reasons, `set_condition`), then `compute`.
Nothing here performs I/O or reads the clock.
"""

from pd_operator.status.compute import (
    NOT_READY_DEADLINE,
    Observed,
    PDDSnapshot,
    RoleObservation,
    compute_status,
    derive_phase,
    pod_is_ready,
)
from pd_operator.status.conditions import (
    CONDITION_TYPES,
    Reason,
    find_condition,
    make_condition,
    set_condition,
)

__all__ = [
    "CONDITION_TYPES",
    "NOT_READY_DEADLINE",
    "Observed",
    "PDDSnapshot",
    "Reason",
    "RoleObservation",
    "compute_status",
    "derive_phase",
    "find_condition",
    "make_condition",
    "pod_is_ready",
    "set_condition",
]
