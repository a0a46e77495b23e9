"""Status of a PDDeployment, computed as data: conditions and their reasons (`conditions`),
transfer health from the pods' TransferAgent reports (`transfer`), and the aggregation of
observed pods and children into `PDDeploymentStatus` (`compute`).

Reading order: `conditions` (types, reasons, `set_condition`), `transfer`, then `compute`.
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
    PodReason,
    Reason,
    find_condition,
    make_condition,
    set_condition,
)
from pd_operator.status.transfer import (
    PodReport,
    ReportState,
    compute_pod_reports,
    compute_transfer_status,
    next_stale_in,
)

__all__ = [
    "CONDITION_TYPES",
    "NOT_READY_DEADLINE",
    "Observed",
    "PDDSnapshot",
    "PodReason",
    "PodReport",
    "Reason",
    "ReportState",
    "RoleObservation",
    "compute_pod_reports",
    "compute_status",
    "compute_transfer_status",
    "derive_phase",
    "find_condition",
    "make_condition",
    "next_stale_in",
    "pod_is_ready",
    "set_condition",
]
