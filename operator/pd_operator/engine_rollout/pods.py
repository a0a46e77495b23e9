"""What an engine rollout reads of a role's engine instances, from one fleet observation.

An instance is identified by its pod's name and `pd.serving.dev/instance` label
(`api.naming.instance_name`); a pod without that label is a *legacy* pod, the pod of a
previous release's StatefulSet, which a rollout replaces like any old-revision instance.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from pd_contract.health import own_failures
from pd_contract.names import LABEL_ENGINE_INSTANCE, LABEL_KV_COMPAT
from pd_contract.transferagent import Role
from pd_operator.status.fleet import FleetObservation, PodObservation, ReportState

__all__ = ["START_FAILURES", "Instance", "RoleTarget", "instance_index", "name_index",
           "observe_instances"]

# A container waiting for one of these will not start by itself: a bad image or a bad
# reference in the pod template.
START_FAILURES: Final = frozenset({
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
    "CreateContainerError",
})


@dataclass(frozen=True)
class Instance:
    """One engine instance (its pod) as a rollout sees it."""

    name: str
    uid: str
    role: Role
    revision: str
    kv_compat: str
    ready: bool
    deleting: bool
    index: int | None = None  # None: a legacy pod (no instance label)
    failed: bool = False  # phase Failed or Succeeded: its containers will not run again
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
    # what its leaving would cost, from its agent's fresh report (None: not reported)
    requests: int | None = None
    pending_kv_bytes: int = 0

    @property
    def serving(self) -> bool:
        """Ready and not on its way out: the router may pair it."""
        return self.ready and not self.deleting

    @property
    def legacy(self) -> bool:
        return self.index is None

    def cost(self) -> tuple[int, int, int, int]:
        """The order in which instances leave, cheapest first: not Ready, then the fewest
        requests in its engine (unknown counts as many), the least KV waiting to be pulled,
        and the youngest index."""
        requests = self.requests if self.requests is not None else 1 << 30
        return (int(self.serving), requests, self.pending_kv_bytes, -(self.index or 0))

    def cost_text(self) -> str:
        if not self.serving:
            return "not Ready" if not self.deleting else "draining"
        held = "requests unknown" if self.requests is None else f"{self.requests} in flight"
        return f"{held}, {self.pending_kv_bytes} B of KV waiting to be pulled"


@dataclass(frozen=True)
class RoleTarget:
    """One role's target: `revision` is the template new instances get (the spec's, or the
    last good one after a rollback), `spec_revision` the spec's own."""

    role: Role
    desired: int
    revision: str
    kv_compat: str
    spec_revision: str


def name_index(name: str) -> int | None:
    """The index an instance name (`api.naming.instance_name`) ends with; None if none."""
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def instance_index(name: str, labels: Mapping[str, str]) -> int | None:
    """The index an instance's name ends with; None for a pod that is no instance."""
    return name_index(name) if labels.get(LABEL_ENGINE_INSTANCE) == name else None


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


def _instance(observed: PodObservation, max_failure_ratio: float) -> Instance:
    restarts, waiting = _container_facts(observed.body)
    labels = (observed.body.get("metadata") or {}).get("labels") or {}
    phase = (observed.body.get("status") or {}).get("phase")
    report = observed.verdict.report if observed.verdict.fresh else None
    return Instance(
        name=observed.name, uid=observed.uid, role=observed.role,
        revision=observed.revision, kv_compat=str(labels.get(LABEL_KV_COMPAT, "")),
        ready=observed.ready, deleting=observed.deleting,
        index=instance_index(observed.name, labels),
        failed=phase in ("Failed", "Succeeded"),
        restarts=restarts, created_at=_created(observed.body), waiting_reason=waiting,
        transfer_failing=_failing_transfers(observed),
        transfer_detail=observed.verdict.detail,
        request_errors=_request_errors(observed, max_failure_ratio),
        requests=None if report is None else report.engine_requests,
        pending_kv_bytes=0 if report is None else report.pending_kv.bytes,
    )


def observe_instances(fleet: FleetObservation, *,
                      max_failure_ratio: float) -> tuple[Instance, ...]:
    """Every engine instance of `fleet`; `max_failure_ratio` (the deployment's health
    limit) judges the requests its engine ended with a server error."""
    return tuple(_instance(p, max_failure_ratio) for p in fleet.pods)
