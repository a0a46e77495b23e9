"""Status of a PDDeployment, computed as data: conditions and their reasons (`conditions`),
one observation of the engine pods and their TransferAgents per reconcile (`fleet`), transfer
health from its verdicts (`transfer`), the StatefulSet pod-creation failures that exist only
as Events (`child_events`), and the aggregation into `PDDeploymentStatus` (`compute`).

Reading order: `conditions` (types, reasons, `set_condition`), `fleet`, `transfer`, then
`compute`. Nothing here performs I/O or reads the clock.
"""

from pd_operator.status.compute import (
    NOT_READY_DEADLINE,
    Observed,
    PDDSnapshot,
    RoleObservation,
    compute_status,
    derive_phase,
)
from pd_operator.status.conditions import (
    CONDITION_TYPES,
    PodReason,
    Reason,
    find_condition,
    make_condition,
    set_condition,
)
from pd_operator.status.fleet import (
    AgentView,
    FleetObservation,
    PodObservation,
    PodReport,
    ReportState,
    observe_fleet,
    pod_is_ready,
)
from pd_operator.status.transfer import compute_transfer_status

__all__ = [
    "CONDITION_TYPES",
    "NOT_READY_DEADLINE",
    "AgentView",
    "FleetObservation",
    "Observed",
    "PDDSnapshot",
    "PodObservation",
    "PodReason",
    "PodReport",
    "Reason",
    "ReportState",
    "RoleObservation",
    "compute_status",
    "compute_transfer_status",
    "derive_phase",
    "find_condition",
    "make_condition",
    "observe_fleet",
    "pod_is_ready",
    "set_condition",
]
