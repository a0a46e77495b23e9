"""One observation of a PDDeployment's engine pods and their TransferAgents, per reconcile.

Pure: the pods and TransferAgent bodies as listed, the transfer health policy, the desired
revisions and `now` in; a frozen `FleetObservation` out. It is made once per reconcile and
read by everything that judges pods: replica counts and transfer health (`compute`,
`transfer`), the pods' transfer-ready gates (`reconcile.gates`) and the staging rollout
(`rollout.planner.staging_pods`). Nothing downstream parses a TransferAgent again.

Truth rules (docs/failure-modes.md #20, #22):
- incarnation, the only rule: a TransferAgent's status is a pod's own report only when the
  UID that wrote it (`status.podUID`, else the agent's Pod owner reference) is the pod's
  current UID. A StatefulSet pod recreated under the same name inherits its predecessor's
  TransferAgent until its own agent writes; until then it has no report at all;
- a report older than `staleAfterSeconds` makes its pod Stale, never healthy; a TransferAgent
  that does not parse is reported as Invalid, not skipped silently;
- health reads the agents' window counts (`status.window`), so a restarted operator computes
  the same verdicts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Final

from pydantic import ValidationError

from pd_contract.health import own_failures
from pd_contract.transferagent import Role, TransferAgentSpec, TransferAgentStatus
from pd_operator.api.conditions import ConditionStatus
from pd_operator.api.resources import format_validation_error
from pd_operator.api.transfer_spec import TransferHealthPolicy
from pd_operator.build.names import LABEL_ROLE, LABEL_TEMPLATE_HASH, TRANSFER_READY_CONDITION
from pd_operator.status.conditions import PodReason

__all__ = [
    "AgentView",
    "FleetObservation",
    "PodObservation",
    "PodReport",
    "ReportState",
    "observe_fleet",
    "pod_is_ready",
    "reporter_uid",
    "top_reason",
]

Obj = Mapping[str, Any]


class ReportState(StrEnum):
    """What the operator makes of one pod's report."""

    HEALTHY = "Healthy"  # fresh, the agent calls itself healthy, ratio within the limit
    FAILING = "Failing"  # fresh, and the agent says unhealthy or its ratio is above the limit
    STALE = "Stale"  # from the current incarnation, but older than staleAfterSeconds
    MISSING = "Missing"  # no TransferAgent, no report yet, or one of an earlier incarnation
    INVALID = "Invalid"  # the TransferAgent does not parse


_GATE: Final = {
    ReportState.HEALTHY: (ConditionStatus.TRUE, PodReason.TRANSFER_HEALTHY),
    ReportState.FAILING: (ConditionStatus.FALSE, PodReason.TRANSFER_FAILING),
    ReportState.STALE: (ConditionStatus.FALSE, PodReason.REPORT_STALE),
    ReportState.MISSING: (ConditionStatus.FALSE, PodReason.NO_REPORT),
    ReportState.INVALID: (ConditionStatus.FALSE, PodReason.REPORT_INVALID),
}


@dataclass(frozen=True)
class PodReport:
    """One engine pod's verdict and the report it rests on.

    `report` is the current incarnation's report (fresh or stale), None when there is none;
    `detail` is a sentence saying why the pod has its state, for messages.
    """

    pod: str
    role: str
    state: ReportState
    detail: str
    report: TransferAgentStatus | None = None

    @property
    def fresh(self) -> bool:
        return self.state in (ReportState.HEALTHY, ReportState.FAILING)

    @property
    def window_ratio(self) -> float:
        if self.report is None or self.report.window.transfers == 0:
            return 0.0
        window = self.report.window
        return min(1.0, window.failures / window.transfers)

    def gate(self) -> tuple[ConditionStatus, str, str]:
        """(status, reason, message) of the pod's transfer-ready readiness-gate condition."""
        status, reason = _GATE[self.state]
        return status, reason, self.detail


@dataclass(frozen=True)
class AgentView:
    """A TransferAgent as listed, parsed once. A part that does not parse is None and its
    error is kept in `error` (wire paths, e.g. `status.window.transfers: ...`)."""

    name: str
    body: Obj
    spec: TransferAgentSpec | None
    status: TransferAgentStatus | None
    error: str | None = None

    @property
    def reporter_uid(self) -> str:
        return reporter_uid(self.body, self.status)


@dataclass(frozen=True)
class PodObservation:
    """One engine pod: who it is, whether it runs the desired revision, its TransferAgent and
    its verdict. `report` is `verdict.report`: the current incarnation's report or None."""

    name: str
    uid: str
    role: Role
    revision: str
    current_revision: bool
    ready: bool
    deleting: bool
    gated: bool
    body: Obj
    agent: AgentView | None
    verdict: PodReport

    @property
    def report(self) -> TransferAgentStatus | None:
        return self.verdict.report

    def condition(self, type_: str) -> Obj | None:
        """The pod's own condition of `type_` as the kubelet or the operator last set it."""
        conditions = self.body.get("status", {}).get("conditions") or []
        return next((c for c in conditions if c.get("type") == type_), None)


@dataclass(frozen=True)
class FleetObservation:
    """The engine pods of one PDDeployment (sorted by name) and their TransferAgents, at `now`.

    `agents` holds every listed TransferAgent by name, strays of pods that no longer exist
    included (they count for nothing).
    """

    now: datetime
    stale_after_s: float
    pods: tuple[PodObservation, ...] = ()
    agents: Mapping[str, AgentView] = field(default_factory=dict)

    @property
    def reports(self) -> tuple[PodReport, ...]:
        return tuple(p.verdict for p in self.pods)

    def of_role(self, role: Role) -> tuple[PodObservation, ...]:
        return tuple(p for p in self.pods if p.role is role)

    def next_stale_in(self) -> float | None:
        """Seconds until the first fresh report turns stale (None: no fresh report).

        Staleness is the absence of an event, so the reconcile must come back on its own then.
        """
        limit = timedelta(seconds=self.stale_after_s)
        due = [r.report.report_time + limit for r in self.reports
               if r.fresh and r.report is not None and r.report.report_time is not None]
        if not due:
            return None
        return max(0.0, (min(due) - self.now).total_seconds())


def reporter_uid(agent: Obj, status: TransferAgentStatus | None) -> str:
    """UID of the pod incarnation that wrote `status`: its `podUID`, else the agent's Pod
    owner reference ("" when neither says)."""
    if status is not None and status.pod_uid:
        return status.pod_uid
    refs = agent.get("metadata", {}).get("ownerReferences") or []
    return next((str(r.get("uid", "")) for r in refs if r.get("kind") == "Pod"), "")


def _parse_agent(body: Obj) -> AgentView:
    errors = []
    try:
        spec: TransferAgentSpec | None = TransferAgentSpec.model_validate(body.get("spec") or {})
    except ValidationError as exc:
        spec = None
        errors.append(format_validation_error(exc, "spec"))
    try:
        status = (TransferAgentStatus.model_validate(body["status"])
                  if body.get("status") else None)
    except ValidationError as exc:
        status = None
        errors.append(format_validation_error(exc, "status"))
    name = str(body.get("metadata", {}).get("name", ""))
    return AgentView(name, body, spec, status, "; ".join(errors) or None)


def _verdict(
    pod: tuple[str, str, str], agent: AgentView | None, health: TransferHealthPolicy,
    now: datetime,
) -> PodReport:
    """The verdict on `pod` (name, role, uid) from its TransferAgent, if any."""
    name, role, uid = pod
    if agent is None:
        return PodReport(name, role, ReportState.MISSING, "it has no TransferAgent yet.")
    if agent.error is not None:
        return PodReport(name, role, ReportState.INVALID,
                         f"its TransferAgent does not parse: {agent.error}.")
    status = agent.status
    if status is None or status.report_time is None:
        return PodReport(name, role, ReportState.MISSING, "its agent has not reported yet.")
    reported_uid = agent.reporter_uid
    if reported_uid != uid:
        return PodReport(name, role, ReportState.MISSING,
                         f"its only report comes from an earlier incarnation (pod UID "
                         f"{reported_uid or 'not given'}); the current pod has not reported "
                         "yet.")
    age_s = (now - status.report_time).total_seconds()
    if age_s > health.stale_after_seconds:
        return PodReport(name, role, ReportState.STALE,
                         f"its last report is {age_s:.0f} s old (limit "
                         f"{health.stale_after_seconds} s); the agent may be hung or gone.",
                         status)
    window = status.window
    own = own_failures(window.failures, window.failures_by_reason)
    ratio = min(1.0, own / window.transfers) if window.transfers else 0.0
    peer = window.failures - own
    by_peers = f" ({peer} of them because a peer went away)" if peer else ""
    if status.healthy is False or ratio > health.max_failure_ratio:
        top = top_reason(window.failures_by_reason) or top_reason(status.failures_by_reason)
        detail = (f"{window.failures} of {window.transfers} transfers failed in the last "
                  f"{window.seconds} s{by_peers}; its own failures: {ratio:.0%}, limit "
                  f"{health.max_failure_ratio:.0%}")
        if top:
            detail += f", mostly {top}"
        if status.last_error:
            detail += f"; last error: {status.last_error}"
        return PodReport(name, role, ReportState.FAILING, detail + ".", status)
    return PodReport(name, role, ReportState.HEALTHY,
                     f"{window.failures} of {window.transfers} transfers failed in the last "
                     f"{window.seconds} s{by_peers}; the agent reports healthy.", status)


def top_reason(counts: Mapping[str, int]) -> str | None:
    """The reason with the most failures (ties: alphabetical), None when there are none."""
    positive = [(n, r) for r, n in counts.items() if n > 0]
    if not positive:
        return None
    return min(positive, key=lambda nr: (-nr[0], nr[1]))[1]


def pod_is_ready(pod: Obj) -> bool:
    """The pod's Ready condition is True and it is not being deleted."""
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _has_transfer_gate(pod: Obj) -> bool:
    """The pod itself declares the gate (an older revision may not, whatever the spec says)."""
    gates = pod.get("spec", {}).get("readinessGates") or []
    return any(g.get("conditionType") == TRANSFER_READY_CONDITION for g in gates)


def observe_fleet(
    pods: Sequence[Obj],
    agents: Sequence[Obj],
    now: datetime,
    *,
    health: TransferHealthPolicy,
    revisions: Mapping[Role, str] | None = None,
) -> FleetObservation:
    """Observe the engine pods among `pods` (those labelled prefill or decode) with their
    TransferAgents (same name). `revisions` is the desired pod-template hash per role (a pod
    of another revision is not current; no entry: every pod counts as current)."""
    views = {view.name: view for view in map(_parse_agent, agents)}
    observed = []
    for pod in pods:
        meta = pod.get("metadata", {})
        labels = meta.get("labels") or {}
        role = labels.get(LABEL_ROLE)
        if role not in (Role.PREFILL.value, Role.DECODE.value):
            continue
        name = str(meta.get("name", ""))
        uid = str(meta.get("uid", ""))
        revision = str(labels.get(LABEL_TEMPLATE_HASH, ""))
        wanted = (revisions or {}).get(Role(role))
        agent = views.get(name)
        observed.append(PodObservation(
            name=name, uid=uid, role=Role(role), revision=revision,
            current_revision=wanted is None or revision == wanted,
            ready=pod_is_ready(pod), deleting=bool(meta.get("deletionTimestamp")),
            gated=_has_transfer_gate(pod), body=pod, agent=agent,
            verdict=_verdict((name, role, uid), agent, health, now),
        ))
    return FleetObservation(
        now=now, stale_after_s=float(health.stale_after_seconds),
        pods=tuple(sorted(observed, key=lambda p: p.name)), agents=views,
    )
