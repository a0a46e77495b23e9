"""What the engine-rollout planner knows of one pod and of each role's target (pure data,
made from the reconcile's one `FleetObservation`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from pd_contract.health import own_failures
from pd_contract.names import LABEL_KV_COMPAT
from pd_contract.transferagent import Role
from pd_operator.status.fleet import FleetObservation, PodObservation, ReportState

__all__ = ["START_FAILURES", "RoleTarget", "RolloutPod", "rollout_pods"]

# A container waiting for one of these will not start by itself: a bad image or a bad
# reference in the pod template.
START_FAILURES: Final = frozenset({
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
    "CreateContainerError",
})


@dataclass(frozen=True)
class RolloutPod:
    """One engine pod as a rollout sees it."""

    name: str
    uid: str
    role: Role
    ordinal: int
    revision: str
    kv_compat: str
    ready: bool
    deleting: bool
    restarts: int = 0
    created_at: datetime | None = None
    waiting_reason: str = ""  # the first waiting container's reason, "" when none waits
    # its agent's fresh report judges transfers failing, with failures of its own in the
    # window (an agent that cannot read a rank of an engine still starting says unhealthy
    # with no transfer at all: that is no verdict on the revision)
    transfer_failing: bool = False
    transfer_detail: str = ""
    # its agent's fresh report counts requests its engine ended with a server error above
    # maxFailureRatio of those it ended in the window ("" when not, or not counted)
    request_errors: str = ""

    @property
    def serving(self) -> bool:
        """Ready and not on its way out: the router may pair it."""
        return self.ready and not self.deleting


@dataclass(frozen=True)
class RoleTarget:
    """One role's target: `revision` is the template the StatefulSet runs (the spec's, or
    the last good one after a rollback), `spec_revision` the spec's own."""

    role: Role
    desired: int
    revision: str
    kv_compat: str
    spec_revision: str
    live_replicas: int | None  # the StatefulSet's spec.replicas now; None: not created yet


def _ordinal(name: str) -> int:
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _container_facts(body: Mapping[str, Any]) -> tuple[int, str]:
    statuses = (body.get("status") or {}).get("containerStatuses") or []
    restarts = max((int(s.get("restartCount") or 0) for s in statuses), default=0)
    waiting = next((str(s["state"]["waiting"].get("reason") or "") for s in statuses
                    if (s.get("state") or {}).get("waiting")), "")
    return restarts, waiting


def _created(body: Mapping[str, Any]) -> datetime | None:
    stamp = (body.get("metadata") or {}).get("creationTimestamp")
    if not stamp:
        return None
    return datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))


def _failing_transfers(observed: PodObservation) -> bool:
    report = observed.verdict.report
    if observed.verdict.state is not ReportState.FAILING or report is None:
        return False
    return own_failures(report.window.failures, report.window.failures_by_reason) > 0


def _request_errors(observed: PodObservation, max_failure_ratio: float) -> str:
    report = observed.verdict.report
    if observed.verdict.state not in (ReportState.HEALTHY, ReportState.FAILING) or (
            report is None):
        return ""
    window = report.window
    # A request whose KV load failed because its peer went away (a prefill killed, its lease
    # over) is no fault of this pod's revision: as for its transfer health, those are taken
    # off (one per failed transfer, so a TP>1 pod takes off more: never a false rollback).
    peer_caused = window.failures - own_failures(window.failures, window.failures_by_reason)
    errors = max(0, (window.request_errors or 0) - peer_caused)
    requests = window.requests or 0
    if errors == 0 or errors <= max_failure_ratio * requests:
        return ""
    return (f"{errors} of the {requests} requests its engine ended in the last "
            f"{window.seconds} s ended with a server error no peer caused (limit "
            f"{max_failure_ratio:.0%})")


def _pod(observed: PodObservation, max_failure_ratio: float) -> RolloutPod:
    restarts, waiting = _container_facts(observed.body)
    labels = (observed.body.get("metadata") or {}).get("labels") or {}
    return RolloutPod(
        name=observed.name, uid=observed.uid, role=observed.role,
        ordinal=_ordinal(observed.name), revision=observed.revision,
        kv_compat=str(labels.get(LABEL_KV_COMPAT, "")), ready=observed.ready,
        deleting=observed.deleting, restarts=restarts, created_at=_created(observed.body),
        waiting_reason=waiting,
        transfer_failing=_failing_transfers(observed),
        transfer_detail=observed.verdict.detail,
        request_errors=_request_errors(observed, max_failure_ratio),
    )


def rollout_pods(fleet: FleetObservation, *,
                 max_failure_ratio: float) -> tuple[RolloutPod, ...]:
    """Every engine pod of `fleet`; `max_failure_ratio` (the deployment's health limit)
    judges the requests its engine ended with a server error."""
    return tuple(_pod(p, max_failure_ratio) for p in fleet.pods)
