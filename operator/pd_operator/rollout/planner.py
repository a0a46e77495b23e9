"""The staging-pool rollout as pure arithmetic: observed pods in, the next step out.

`plan_rollout(desired, last_good, pods, *, policy, previous, now, stale_after_s)` returns a
`RolloutDecision`: the new `status.stagingRollout`, the TransferAgent spec sizes to write now
(only changes) and the events to emit. It performs no I/O and reads no clock; the executor
makes the API calls. Every step is derived from what the pods report, never from memory, so a
restarted operator computes the same step (lws `disaggregatedset/planner.go`).

The status carries only what cannot be observed: the from/to pair, `startedAt`, the `mode`
(Forward, Hold or Rollback) and, once a batch failed analysis, `rollbackReason` (an
`api.status.RollbackReason`) with `rollbackMessage` (the failed pod and its numbers). The
planner reads these fields back and never parses `message`, which is for people. Two per-pod
times cannot be
observed from a TransferAgent either and come in with each `PodRollout`: when its spec size was
written (`written_at`, stamped by the executor with each write) and since when its report shows
that size in force (`applied_at`; the executor stamps `now` for the pods a decision lists in
`applied_now`). A pod of which either time is unknown is judged as if it happened now, which
can only lengthen analysis and deadlines, never shorten them.

Terms. A pod's *effective size* is the size its own role allocates: the decode ring
(decodePoolMiB) on decode pods, the prefill buffer (prefillBufferMiB) on prefill pods. A pod
is *resizing* when the effective size of its report differs from its spec's or its report says
`resizing` (a pod with no report yet is starting, not resizing); a pod whose report differs
from its spec only in the other role's size is *confirming*: its agent takes such a spec at
once, without a resize. A rollout *changes* a pod when its source and target differ in the
pod's effective size (a decodePoolMiB-only rollout changes no prefill pod). A pod's *ring* is
the decode pool it may hold (decode pods: the smaller of spec and report); its *chunk limit*
is the decode pool it may assume when it writes (prefill pods: the larger of spec and report).

Modes, from `previous` (its `mode`) and `desired`:
- Refused: `desired` is below the one-chunk `minimum` → Paused, no mode, no rollout starts.
- Start: `desired` differs from `previous.to` → from = last good, to = desired, then Forward
  (or Idle at once when every pod already runs `desired`).
- Forward (Progressing, then Complete): source = from, target = to.
- A stopped rollout (mode Hold or Rollback) follows the policy in force: Hold (Paused,
  `autoRollback` off) writes no sizes until `desired` changes; Rollback (Paused under
  `autoRollback`, then RolledBack, which stays so) has source = to, target = from.

Step formula. Let B = pods that have a spec equal to the target and are resizing, or that the
rollout changes and report the target in force for less than `analysisSeconds` (the current
batch), R = reported pods not yet at the target (a confirming pod is not at it yet: no pod
counts as updated, and no rollout completes, before its own report says the target), U =
`maxUnavailable`.
- Forward: a pod of B, or one already updated, that fails analysis (report older than
  `staleAfterSeconds`, window failure ratio above `maxFailureRatio`, agent says unhealthy, or
  its write not in force, resizing or confirming, within 2 × analysisSeconds + 120 s) stops
  the rollout (Rollback or Hold); the message names the pod and the reason. Otherwise, if B
  and R are both empty → Complete; if B is empty → write the target to the first
  min(U, |R|) pods of R, in order, that keep the ring rule below, together with every pod of
  R the rollout does not change that keeps it (they are not resizing: no batch, no
  analysis, not counted in U), or, with nothing to write, wait for confirming pods; else
  wait.
- Rollback: write the source size back to pods of R in order while the resizing count stays
  ≤ U and the ring rule holds; no analysis (there is nowhere further back to go). Re-targeting a
  pod that is already resizing does not add to the count. When R is empty → RolledBack.
Invariant at every step, in every mode: at most U pods resizing (the planner never writes a
change that would exceed it).

Order and the ring rule. A prefill writer is granted regions of a decode ring and sends whole
chunks, so no prefill chunk limit may exceed the smallest decode ring it writes into: at every
step max(chunk limits) ≤ min(rings). When the pool grows, decode rings grow first and prefill
limits follow; when it shrinks, prefill limits shrink first and decode rings follow. The
planner does not hard-code this: it orders loosening moves (a ring that grows, a limit that
shrinks) before tightening ones and writes a move only if the rule still holds after it, which
yields exactly these orders and stays safe from any mixed state (a rollout changed mid-way).
Within a tier: decode first when the decode pool grows, prefill first otherwise; then by name.

New pods (no TransferAgent spec yet: scale-up, or a restarted pod whose TransferAgent went
with its predecessor) get the size in force for their revision: the rollout's `to` if the pod's
name is in the updated set (`previous.updatedPods`: the restart of an updated pod) while
rolling forward, the source size otherwise (the last good size while rolling forward, the `to`
size while rolling back) — each only if the ring rule allows it, else the other one.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Final

from pd_contract.transferagent import AgentStaging, Role
from pd_operator.api.sizing import compute_staging_footprint
from pd_operator.api.spec import PDDeploymentSpec, Staging, StagingRollout
from pd_operator.api.status import (
    RollbackReason,
    RolloutMode,
    RolloutPhase,
    StagingRolloutStatus,
)
from pd_operator.status.fleet import PodObservation

__all__ = [
    "APPLY_GRACE_SECONDS",
    "EventType",
    "Failure",
    "PodHealth",
    "PodRollout",
    "RolloutDecision",
    "RolloutEvent",
    "RolloutReason",
    "SpecWrite",
    "StagingTarget",
    "apply_deadline_seconds",
    "compute_minimum_staging",
    "observe_pod",
    "plan_rollout",
]

# A resize waits for the grants already made on the ring to drain (bounded by the default
# 60 s transferSeconds) and shows up in the next report (10 s reportIntervalSeconds); 120 s
# covers both twice over.
APPLY_GRACE_SECONDS: Final = 120.0


class EventType(StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


class RolloutReason(StrEnum):
    """Event reasons of the staging rollout (one CamelCase word each)."""

    STARTED = "StagingRolloutStarted"
    BATCH = "StagingBatchResizing"
    COMPLETE = "StagingRolloutComplete"
    PAUSED = "StagingRolloutPaused"
    ROLLING_BACK = "StagingRollbackStarted"
    ROLLED_BACK = "StagingRolledBack"
    REFUSED = "StagingRolloutRefused"


@dataclass(frozen=True, order=True)
class StagingTarget:
    """The staging sizes of one pod: decode ring and prefill buffer per rank, in MiB."""

    decode_pool_mib: int
    prefill_buffer_mib: int

    @classmethod
    def of(cls, staging: Staging | AgentStaging) -> StagingTarget:
        return cls(staging.decode_pool_mib, staging.prefill_buffer_mib)

    def to_agent(self) -> AgentStaging:
        return AgentStaging(
            decode_pool_mib=self.decode_pool_mib, prefill_buffer_mib=self.prefill_buffer_mib
        )

    def __str__(self) -> str:
        return f"decodePoolMiB={self.decode_pool_mib}/prefillBufferMiB={self.prefill_buffer_mib}"


def compute_minimum_staging(spec: PDDeploymentSpec) -> StagingTarget:
    """The smallest sizes that hold one prefill chunk: the floor `plan_rollout` refuses below."""
    footprint = compute_staging_footprint(spec)
    return StagingTarget(footprint.min_decode_pool_mib, footprint.min_prefill_buffer_mib)


@dataclass(frozen=True)
class PodHealth:
    """Transfer health from one pod's latest report (its `status.window` and `healthy`)."""

    transfers: int = 0
    failures: int = 0
    healthy: bool | None = None
    report_time: datetime | None = None

    @property
    def failure_ratio(self) -> float:
        return self.failures / self.transfers if self.transfers else 0.0


@dataclass(frozen=True)
class PodRollout:
    """What the planner observes of one engine pod.

    `spec` is the size its TransferAgent spec asks for (None: no TransferAgent spec yet);
    `reported` the size its current incarnation reports in force (None: no report yet, or only
    a predecessor's). `written_at` and `applied_at`: see the module docstring.
    """

    name: str
    role: Role
    uid: str
    spec: StagingTarget | None
    reported: StagingTarget | None
    resizing: bool = False
    health: PodHealth = PodHealth()
    written_at: datetime | None = None
    applied_at: datetime | None = None

    def effective(self, size: StagingTarget) -> int:
        """The MiB of `size` this pod's role allocates (module docstring)."""
        return size.decode_pool_mib if self.role is Role.DECODE else size.prefill_buffer_mib

    @property
    def is_resizing(self) -> bool:
        if self.reported is None:
            return False
        if self.spec is None or self.resizing:
            return True
        return self.effective(self.spec) != self.effective(self.reported)

    @property
    def is_pending(self) -> bool:
        """Reported, and its report not yet its spec: resizing or confirming."""
        return self.reported is not None and (self.spec != self.reported or self.resizing)

    def settled_at(self, size: StagingTarget) -> bool:
        """Spec and report both `size`, and no resize under way."""
        return self.spec == size and self.reported == size and not self.resizing


def observe_pod(
    pod: PodObservation, *, written_at: datetime | None = None,
    applied_at: datetime | None = None,
) -> PodRollout:
    """A `PodRollout` from one pod of the fleet observation. Its report is the fleet's: a
    report written by another incarnation (a StatefulSet pod recreated under the same name)
    is no report, so the new pod is never judged by its predecessor's numbers."""
    spec = pod.agent.spec if pod.agent is not None else None
    report = pod.report
    return PodRollout(
        name=pod.name,
        role=pod.role,
        uid=pod.uid,
        spec=StagingTarget.of(spec.staging) if spec is not None else None,
        reported=StagingTarget.of(report.staging)
        if report is not None and report.staging is not None else None,
        resizing=report is not None and report.resizing,
        health=PodHealth(
            transfers=report.window.transfers,
            failures=report.window.failures,
            healthy=report.healthy,
            report_time=report.report_time,
        ) if report is not None else PodHealth(),
        written_at=written_at,
        applied_at=applied_at,
    )


@dataclass(frozen=True)
class SpecWrite:
    """Set `pod`'s TransferAgent `spec.staging` to `size`, and stamp the write time."""

    pod: str
    size: StagingTarget


@dataclass(frozen=True)
class RolloutEvent:
    type: EventType
    reason: RolloutReason
    message: str


@dataclass(frozen=True)
class RolloutDecision:
    """The next step: write `status`, then `writes`, emit `events` after the status write
    succeeded, and record `now` as `applied_at` of the pods in `applied_now`."""

    status: StagingRolloutStatus
    writes: tuple[SpecWrite, ...] = ()
    events: tuple[RolloutEvent, ...] = ()
    applied_now: tuple[str, ...] = ()


def apply_deadline_seconds(policy_analysis_seconds: float) -> float:
    """How long a written size may take to be in force and analysed: 2 × analysis + grace."""
    return 2 * policy_analysis_seconds + APPLY_GRACE_SECONDS


@dataclass(frozen=True)
class Failure:
    """Why a pod failed analysis: the reason stored in the status, and the sentence."""

    reason: RollbackReason
    message: str


# What a stored stop without its sentence (a hand-edited status) is called.
_UNSAID: Final = "rollback requested"
_ROLLING_BACK: Final = "; rolling back to "
_ROLLED_BACK: Final = "; rolled back to "
_PAUSED: Final = "; paused: set decodePoolMiB back to "


def plan_rollout(
    desired: StagingTarget,
    last_good: StagingTarget | None,
    pods: Sequence[PodRollout],
    *,
    policy: StagingRollout,
    previous: StagingRolloutStatus,
    now: datetime,
    stale_after_s: float,
    minimum: StagingTarget | None = None,
) -> RolloutDecision:
    """The next rollout step for `pods` towards `desired` (see the module docstring).

    `last_good` is the size that last rolled out completely; None derives it from `previous`
    (or, with no record at all, from what most pods' specs ask for). `minimum`, normally
    `compute_minimum_staging(spec)` when staging is in use, is the floor below which no
    rollout starts. `stale_after_s` is `spec.transfer.health.staleAfterSeconds`.
    """
    pods = sorted(pods, key=lambda p: _natural(p.name))
    good = last_good or _derive_last_good(previous, pods, desired)
    prev_from, prev_to = _sizes(previous)
    ctx = _Context(pods, policy=policy, previous=previous, now=now,
                   stale_after_s=stale_after_s, good=good)

    if minimum is not None and (
        desired.decode_pool_mib < minimum.decode_pool_mib
        or desired.prefill_buffer_mib < minimum.prefill_buffer_mib
    ):
        return ctx.refuse(desired, good, minimum)
    if prev_to != desired or prev_from is None:
        initial = ctx.newcomers(good, desired, forward=True)
        if all(_at(p, desired) for p in _apply(pods, initial)):
            return ctx.finish(RolloutPhase.IDLE, None, desired, started_at=None, message="",
                              writes=initial, mode=None)
        return ctx.forward(good, desired, started_at=now, starting=True)
    started_at = previous.started_at or now
    if _mode_of(previous) is RolloutMode.FORWARD:
        return ctx.forward(prev_from, prev_to, started_at=started_at, starting=False)
    failure = Failure(previous.rollback_reason or RollbackReason.NO_REPORT,
                      previous.rollback_message or _UNSAID)
    if previous.phase is RolloutPhase.ROLLED_BACK or policy.auto_rollback:
        return ctx.rollback(prev_from, prev_to, started_at=started_at, failure=failure)
    return ctx.hold(prev_from, prev_to, started_at=started_at, failure=failure)


def _mode_of(previous: StagingRolloutStatus) -> RolloutMode:
    """The stored mode; a status written before the field existed is read from its phase."""
    if previous.mode is not None:
        return previous.mode
    if previous.phase in (RolloutPhase.PAUSED, RolloutPhase.ROLLED_BACK):
        return RolloutMode.ROLLBACK
    return RolloutMode.FORWARD


class _Context:
    """One planning pass: the observed pods, the policy and the clock, shared by the modes."""

    def __init__(
        self,
        pods: list[PodRollout],
        *,
        policy: StagingRollout,
        previous: StagingRolloutStatus,
        now: datetime,
        stale_after_s: float,
        good: StagingTarget,
    ) -> None:
        self.pods = pods
        self.good = good
        self.policy = policy
        self.previous = previous
        self.now = now
        self.stale_after_s = stale_after_s

    # -- modes ---------------------------------------------------------------------------

    def forward(
        self, source: StagingTarget, target: StagingTarget, *, started_at: datetime,
        starting: bool,
    ) -> RolloutDecision:
        writes = self.newcomers(source, target, forward=True)
        view = _apply(self.pods, writes)
        events: list[RolloutEvent] = []
        if starting:
            events.append(RolloutEvent(
                EventType.NORMAL, RolloutReason.STARTED,
                f"Rolling out {target} (from {source}) in batches of "
                f"{self.policy.max_unavailable}",
            ))
        if (not starting and self.previous.phase is RolloutPhase.COMPLETE
                and all(_at(p, target) for p in view)):
            # Done: health is the TransferHealthy condition's business from here on.
            return self.finish(RolloutPhase.COMPLETE, source, target, started_at=started_at,
                               message=self.previous.message, writes=writes)
        # A pod resizing towards the target is waited for even where the rollout does not
        # change it (a mixed state left by an earlier rollout).
        batch = [p for p in view if p.spec == target and p.reported is not None and (
            p.is_resizing or (_changes(p, source, target) and self._analysing(p)))]
        # The batch first (its failure is the likely one to name), then every pod already
        # updated: a step is taken only while all of them report fresh, healthy numbers.
        judged = batch + [p for p in view if p not in batch and p.spec == target
                          and p.reported is not None]
        failure = next((r for r in (self._failure(p, target) for p in judged) if r), None)
        if failure is not None:
            if self.policy.auto_rollback:
                events.append(RolloutEvent(
                    EventType.WARNING, RolloutReason.ROLLING_BACK,
                    f"{failure.message}{_ROLLING_BACK}{source}",
                ))
                return self.rollback(source, target, started_at=started_at, failure=failure,
                                     writes=writes, events=events)
            held = self.hold(source, target, started_at=started_at, failure=failure,
                             writes=writes)
            events.append(RolloutEvent(EventType.WARNING, RolloutReason.PAUSED,
                                       held.status.message))
            return RolloutDecision(held.status, held.writes, tuple(events), held.applied_now)
        remaining = [p for p in view if not _at(p, target)]
        if not batch and not remaining:
            if self.previous.phase is not RolloutPhase.COMPLETE or starting:
                events.append(RolloutEvent(EventType.NORMAL, RolloutReason.COMPLETE,
                                           f"Rolled out {target} to {len(view)} pods"))
            return self.finish(RolloutPhase.COMPLETE, source, target, started_at=started_at,
                               message=f"Rolled out {target}", writes=writes, events=events)
        if batch:
            names = _names(batch)
            if any(p.is_resizing for p in batch):
                message = f"Batch {names}: waiting for {target} in force"
            else:
                message = (f"Batch {names}: analysing transfer health for "
                           f"{self.policy.analysis_seconds}s")
            return self.finish(RolloutPhase.PROGRESSING, source, target, started_at=started_at,
                               message=message, writes=writes, events=events)
        moves = self._moves(view, source, target, limit=self.policy.max_unavailable)
        if moves:
            message = _moves_message(view, moves, source, target)
            if any(_changes(p, source, target) for p in view if p.name in _pods(moves)):
                events.append(RolloutEvent(EventType.NORMAL, RolloutReason.BATCH, message))
            return self.finish(RolloutPhase.PROGRESSING, source, target, started_at=started_at,
                               message=message, writes=writes + moves, events=events)
        confirming = [p for p in view if p.spec == target and p.is_pending]
        if confirming:
            return self.finish(RolloutPhase.PROGRESSING, source, target, started_at=started_at,
                               message=f"Waiting for {_names(confirming)} to confirm {target} "
                               "(size in force unchanged)", writes=writes, events=events)
        return self.finish(RolloutPhase.PROGRESSING, source, target, started_at=started_at,
                           message=self._blocked_message(view, target), writes=writes,
                           events=events)

    def rollback(
        self, rollout_from: StagingTarget, rollout_to: StagingTarget, *, started_at: datetime,
        failure: Failure, writes: tuple[SpecWrite, ...] | None = None,
        events: list[RolloutEvent] | None = None,
    ) -> RolloutDecision:
        """Return every pod to `rollout_from`; `writes`/`events` carry what the calling
        mode already decided in this pass (newcomers of the forward pass, its warning)."""
        events = events if events is not None else []
        if writes is None:
            writes = self.newcomers(rollout_to, rollout_from, forward=False)
        else:
            # Newcomers written by the forward pass were sized for rolling forward: size
            # them again for rolling back.
            fresh = {p.name for p in self.pods if p.spec is None}
            writes = tuple(w for w in writes if w.pod not in fresh) + self.newcomers(
                rollout_to, rollout_from, forward=False)
        view = _apply(self.pods, writes)
        remaining = [p for p in view if not _at(p, rollout_from)]
        if not remaining:
            message = f"{failure.message}{_ROLLED_BACK}{rollout_from}"
            if self.previous.phase is not RolloutPhase.ROLLED_BACK:
                events.append(RolloutEvent(EventType.WARNING, RolloutReason.ROLLED_BACK,
                                           message))
            return self.finish(RolloutPhase.ROLLED_BACK, rollout_from, rollout_to,
                               started_at=started_at, message=message, writes=writes,
                               events=events, mode=RolloutMode.ROLLBACK, failure=failure)
        in_flight = sum(p.is_resizing for p in view)
        moves = self._moves(view, rollout_to, rollout_from,
                            limit=self.policy.max_unavailable - in_flight, retarget=True)
        return self.finish(RolloutPhase.PAUSED, rollout_from, rollout_to, started_at=started_at,
                           message=f"{failure.message}{_ROLLING_BACK}{rollout_from}",
                           writes=writes + moves, events=events, mode=RolloutMode.ROLLBACK,
                           failure=failure)

    def hold(self, source: StagingTarget, target: StagingTarget, *, started_at: datetime,
             failure: Failure, writes: tuple[SpecWrite, ...] | None = None) -> RolloutDecision:
        """Paused where every pod is; only newcomers get a size."""
        if writes is None:
            writes = self.newcomers(source, target, forward=True)
        message = f"{failure.message}{_PAUSED}{source} to roll back, or to a new size"
        return self.finish(RolloutPhase.PAUSED, source, target, started_at=started_at,
                           message=message, writes=writes, mode=RolloutMode.HOLD,
                           failure=failure)

    def refuse(self, desired: StagingTarget, good: StagingTarget,
               minimum: StagingTarget) -> RolloutDecision:
        """Paused without a `to`: nothing of a refused size is recorded, so a later spec (or a
        smaller chunk that lowers the minimum) starts a rollout normally."""
        message = (
            f"Refusing {desired}: one prefill chunk needs at least "
            f"decodePoolMiB={minimum.decode_pool_mib} and "
            f"prefillBufferMiB={minimum.prefill_buffer_mib}; pods keep their sizes"
        )
        events: list[RolloutEvent] = []
        if self.previous.message != message:
            events.append(RolloutEvent(EventType.WARNING, RolloutReason.REFUSED, message))
        return self.finish(RolloutPhase.PAUSED, good, None, started_at=None, message=message,
                           writes=self.newcomers(good, good, forward=True), events=events,
                           mode=None)

    def finish(
        self, phase: RolloutPhase, source: StagingTarget | None, target: StagingTarget | None,
        *, started_at: datetime | None, message: str, writes: tuple[SpecWrite, ...],
        events: Iterable[RolloutEvent] = (), mode: RolloutMode | None = RolloutMode.FORWARD,
        failure: Failure | None = None,
    ) -> RolloutDecision:
        view = _apply(self.pods, writes)
        updated = ([] if target is None or phase is RolloutPhase.IDLE else
                   [p.name for p in view if p.reported == target and not p.resizing])
        status = StagingRolloutStatus(
            phase=phase,
            from_decode_pool_mib=source.decode_pool_mib if source else None,
            to_decode_pool_mib=target.decode_pool_mib if target else None,
            from_prefill_buffer_mib=source.prefill_buffer_mib if source else None,
            to_prefill_buffer_mib=target.prefill_buffer_mib if target else None,
            updated_pods=updated,
            total_pods=len(view),
            message=message,
            started_at=started_at,
            summary=_summary(phase, source, target, view,
                             rolling_back=mode is RolloutMode.ROLLBACK),
            mode=mode,
            rollback_reason=failure.reason if failure is not None else None,
            rollback_message=failure.message if failure is not None else "",
        )
        applied_now = tuple(p.name for p in view if p.applied_at is None
                            and p.reported is not None and p.settled_at(p.reported))
        return RolloutDecision(status, writes, tuple(events), applied_now)

    # -- pieces --------------------------------------------------------------------------

    def newcomers(self, source: StagingTarget, target: StagingTarget, *,
                  forward: bool) -> tuple[SpecWrite, ...]:
        """Initial spec sizes for pods without a TransferAgent spec (module docstring)."""
        writes: list[SpecWrite] = []
        updated = set(self.previous.updated_pods)
        # Prefill limits first, checked against the rings in place; a new decode pod then
        # takes a ring that fits every limit, the new ones included.
        for pod in sorted((p for p in self.pods if p.spec is None),
                          key=lambda p: (p.role is not Role.PREFILL, _natural(p.name))):
            preferred = target if forward and pod.name in updated else self.good
            view = _apply(self.pods, tuple(writes))
            # After a rollout changed mid-way, neither end may fit: then a size already in
            # the fleet does (the largest ring for a decode pod, the smallest limit for a
            # prefill pod), and the pod is moved on from there like any other.
            seen = sorted({s for p in view for s in (p.spec, p.reported) if s is not None},
                          reverse=pod.role is Role.DECODE)
            choice = next((size for size in (preferred, self.good, source, target, *seen)
                           if _violation(_apply(view, (SpecWrite(pod.name, size),)))
                           <= _violation(view)), preferred)
            writes.append(SpecWrite(pod.name, choice))
        return tuple(writes)

    def _moves(self, view: list[PodRollout], source: StagingTarget, target: StagingTarget, *,
               limit: int, retarget: bool = False) -> tuple[SpecWrite, ...]:
        """Up to `limit` new resizes towards `target` (re-targeting an already resizing pod
        is free when `retarget`), in order, each keeping the ring rule and the resizing
        count ≤ maxUnavailable."""
        grows = target.decode_pool_mib > source.decode_pool_mib

        def order(p: PodRollout) -> tuple[bool, bool, tuple[object, ...]]:
            first = Role.DECODE if grows else Role.PREFILL
            return (_tightens(p, target), p.role is not first, _natural(p.name))

        candidates = sorted(
            (p for p in view if p.reported is not None and p.spec != target
             and (retarget or not p.is_resizing)),
            key=order,
        )
        moves: list[SpecWrite] = []
        for pod in candidates:
            current = _apply(view, tuple(moves))
            trial = _apply(current, (SpecWrite(pod.name, target),))
            added = sum(p.is_resizing for p in trial) - sum(p.is_resizing for p in current)
            if added > 0 and limit <= 0:
                continue
            if _violation(trial) > _violation(current):
                continue
            if sum(p.is_resizing for p in trial) > self.policy.max_unavailable:
                continue
            moves.append(SpecWrite(pod.name, target))
            limit -= max(added, 0)
        return tuple(moves)

    def _analysing(self, pod: PodRollout) -> bool:
        since = pod.applied_at or self.now
        return since + timedelta(seconds=self.policy.analysis_seconds) > self.now

    def _failure(self, pod: PodRollout, target: StagingTarget) -> Failure | None:
        """Why `pod` (of the current batch) fails analysis, or None."""
        health = pod.health
        if health.report_time is None:
            return Failure(RollbackReason.NO_REPORT, f"{pod.name}: no transfer report")
        age = (self.now - health.report_time).total_seconds()
        if age > self.stale_after_s:
            return Failure(RollbackReason.REPORT_STALE,
                           f"{pod.name}: transfer report is {age:.0f}s old "
                           f"(stale after {self.stale_after_s:.0f}s)")
        if health.failure_ratio > self.policy.max_failure_ratio:
            return Failure(RollbackReason.FAILURE_RATIO,
                           f"{pod.name}: transfer failure ratio {health.failure_ratio:.3f} "
                           f"({health.failures}/{health.transfers}) is above maxFailureRatio "
                           f"{self.policy.max_failure_ratio}")
        if health.healthy is False:
            return Failure(RollbackReason.AGENT_UNHEALTHY,
                           f"{pod.name}: its agent reports transfers unhealthy")
        deadline_s = apply_deadline_seconds(self.policy.analysis_seconds)
        written = pod.written_at or self.now
        if pod.is_pending and (self.now - written).total_seconds() > deadline_s:
            return Failure(RollbackReason.NOT_APPLIED,
                           f"{pod.name}: {target} not in force {deadline_s:.0f}s after it was "
                           "written")
        return None

    def _blocked_message(self, view: list[PodRollout], target: StagingTarget) -> str:
        silent = [p for p in view if p.reported is None and not _at(p, target)]
        if silent:
            return f"Waiting for {_names(silent)} to report before resizing"
        return (f"Waiting: resizing {_names([p for p in view if not _at(p, target)])} now "
                "would let a prefill chunk limit exceed a decode ring")


# -- helpers -----------------------------------------------------------------------------


def _at(pod: PodRollout, size: StagingTarget) -> bool:
    """`pod` needs nothing more to run `size`: settled at it, or not reporting yet with its
    spec already `size` (nothing to resize until it reports)."""
    if pod.reported is None:
        return pod.spec == size
    return pod.settled_at(size)


def _changes(pod: PodRollout, source: StagingTarget, target: StagingTarget) -> bool:
    """Whether a rollout from `source` to `target` changes what `pod` allocates."""
    return pod.effective(source) != pod.effective(target)


def _pods(writes: Iterable[SpecWrite]) -> set[str]:
    return {w.pod for w in writes}


def _moves_message(view: Sequence[PodRollout], moves: Sequence[SpecWrite],
                   source: StagingTarget, target: StagingTarget) -> str:
    """"Resizing <changed pods> to <target>", naming apart the pods whose spec only follows
    (their size in force does not change)."""
    moved = _pods(moves)
    resized = [p.name for p in view if p.name in moved and _changes(p, source, target)]
    along = [p.name for p in view if p.name in moved and not _changes(p, source, target)]
    parts = [f"Resizing {', '.join(resized)} to {target}"] if resized else []
    if along:
        parts.append(f"Writing {target} to {', '.join(along)} (size in force unchanged)")
    return "; ".join(parts)


def _apply(pods: Iterable[PodRollout], writes: Iterable[SpecWrite]) -> list[PodRollout]:
    sizes = {w.pod: w.size for w in writes}
    return [
        PodRollout(p.name, p.role, p.uid, sizes[p.name], p.reported, p.resizing, p.health,
                   p.written_at, p.applied_at) if p.name in sizes else p
        for p in pods
    ]


def _violation(pods: Iterable[PodRollout]) -> int:
    """MiB by which the largest prefill chunk limit exceeds the smallest decode ring (0: safe).

    A pod in transition may act on either of its sizes: rings count at their smaller one,
    limits at their larger one."""
    rings: list[int] = []
    limits: list[int] = []
    for pod in pods:
        known = [s.decode_pool_mib for s in (pod.spec, pod.reported) if s is not None]
        if not known:
            continue
        if pod.role is Role.DECODE:
            rings.append(min(known))
        else:
            limits.append(max(known))
    if not rings or not limits:
        return 0
    return max(0, max(limits) - min(rings))


def _tightens(pod: PodRollout, target: StagingTarget) -> bool:
    """Whether moving `pod` to `target` shrinks a ring or grows a chunk limit."""
    current = pod.reported or pod.spec
    if current is None:
        return False
    if pod.role is Role.DECODE:
        return target.decode_pool_mib < current.decode_pool_mib
    return target.decode_pool_mib > current.decode_pool_mib


def _sizes(status: StagingRolloutStatus) -> tuple[StagingTarget | None, StagingTarget | None]:
    def size(pool: int | None, buffer: int | None) -> StagingTarget | None:
        return StagingTarget(pool, buffer) if pool is not None and buffer is not None else None

    return (size(status.from_decode_pool_mib, status.from_prefill_buffer_mib),
            size(status.to_decode_pool_mib, status.to_prefill_buffer_mib))


def _derive_last_good(previous: StagingRolloutStatus, pods: Sequence[PodRollout],
                      desired: StagingTarget) -> StagingTarget:
    """The last size that rolled out completely, as far as `previous` records it."""
    prev_from, prev_to = _sizes(previous)
    if previous.phase in (RolloutPhase.IDLE, RolloutPhase.COMPLETE) and prev_to is not None:
        return prev_to
    if prev_from is not None:
        return prev_from
    specs = Counter(p.spec for p in pods if p.spec is not None)
    if not specs:
        return desired
    # Most common spec size; ties go to the smallest, so the pick does not depend on order.
    top = max(specs.values())
    return min(size for size, count in specs.items() if count == top)


def _summary(phase: RolloutPhase, source: StagingTarget | None, target: StagingTarget | None,
             pods: Sequence[PodRollout], *, rolling_back: bool) -> str:
    """The STAGING printer column: `4096MiB`, or `4096→6144MiB 2/4` while moving."""
    def arrow(a: StagingTarget, b: StagingTarget) -> str:
        if a.decode_pool_mib != b.decode_pool_mib:
            return f"{a.decode_pool_mib}→{b.decode_pool_mib}MiB"
        return f"buffer {a.prefill_buffer_mib}→{b.prefill_buffer_mib}MiB"

    if phase in (RolloutPhase.IDLE, RolloutPhase.COMPLETE) and target is not None:
        return f"{target.decode_pool_mib}MiB"
    if phase is RolloutPhase.ROLLED_BACK and source is not None:
        return f"{source.decode_pool_mib}MiB RolledBack"
    if source is None or target is None:
        return f"{source.decode_pool_mib}MiB Paused" if source is not None else ""
    if rolling_back:
        back = sum(_at(p, source) for p in pods)
        return f"{arrow(target, source)} {back}/{len(pods)} RollingBack"
    done = sum(_at(p, target) for p in pods)
    suffix = " Paused" if phase is RolloutPhase.PAUSED else ""
    return f"{arrow(source, target)} {done}/{len(pods)}{suffix}"


def _names(pods: Iterable[PodRollout]) -> str:
    return ", ".join(p.name for p in pods)


def _natural(name: str) -> tuple[object, ...]:
    """Sort key that puts decode-2 before decode-10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))
