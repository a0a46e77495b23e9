"""The pods' transfer-ready readiness-gate conditions to write, from the fleet's verdicts.

A pod's `pd.serving.dev/transfer-ready` condition follows its own verdict (`status.fleet`);
only conditions that differ in status or reason from the pod's own are written, so a steady
state patches no pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pd_operator.api import ConditionStatus
from pd_operator.build.names import TRANSFER_READY_CONDITION
from pd_operator.status import FleetObservation, ReportState

__all__ = ["GateChange", "transfer_gate_changes"]


@dataclass(frozen=True)
class GateChange:
    """A transfer-ready condition to write on one pod; `announce`: worth an Event."""

    pod: str
    condition: Mapping[str, Any]
    announce: bool
    bad_news: bool


def transfer_gate_changes(fleet: FleetObservation) -> list[GateChange]:
    """The transfer-ready conditions that differ (in status or reason) from the pods' own.

    Pods without the gate and pods being deleted are left alone. lastTransitionTime moves
    only when the status flips. `bad_news` marks changes worth a Warning Event: a flip to
    False, or a first verdict that is already Failing (a new pod that merely has not
    reported yet is not news).
    """
    stamp = fleet.now.strftime("%Y-%m-%dT%H:%M:%SZ")
    changes = []
    for pod in fleet.pods:
        if not pod.gated or pod.deleting:
            continue
        status, reason, message = pod.verdict.gate()
        old = pod.condition(TRANSFER_READY_CONDITION)
        if old is not None and old.get("status") == status.value and \
                old.get("reason") == reason:
            continue
        flipped = old is not None and old.get("status") != status.value
        transition = stamp if old is None or flipped else old.get("lastTransitionTime", stamp)
        condition = {"type": TRANSFER_READY_CONDITION, "status": status.value,
                     "reason": reason, "message": message, "lastTransitionTime": transition}
        announce = flipped or (old is None and pod.verdict.state is ReportState.FAILING)
        changes.append(GateChange(pod.name, condition, announce,
                                  bad_news=status is not ConditionStatus.TRUE))
    return changes
