"""The rollout's modes, one planning pass each: forward, rollback, hold, refuse.

`plan_rollout` (`plan.py`) picks the mode from the stored status and `desired`; a
`RolloutPass` then computes the whole decision for that mode: newcomers' sizes, the batch and
its analysis, the next moves under `maxUnavailable` and the ring rule, the status and the
events (the algorithm is in the package docstring).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Final

from pd_contract.transferagent import AgentStaging, Role
from pd_operator.api.status import (
    RollbackReason,
    RolloutMode,
    RolloutPhase,
    StagingRolloutStatus,
)
from pd_operator.api.transfer_spec import StagingRollout
from pd_operator.staging_rollout.decision import (
    EventType,
    Failure,
    SpecWrite,
    StagingDecision,
    StagingEvent,
    StagingReason,
    apply_deadline_seconds,
)
from pd_operator.staging_rollout.pods import (
    StagingPod,
    at_size,
    changes,
    natural_order,
    pod_names,
    ring_violation,
    size_order,
    tightens,
    with_writes,
)

__all__ = ["RolloutPass"]

_ROLLING_BACK: Final = "; rolling back to "
_ROLLED_BACK: Final = "; rolled back to "
_PAUSED: Final = "; paused: set decodePoolMiB back to "


class RolloutPass:
    """One planning pass: the observed pods, the policy and the clock, shared by the modes.

    `plan_rollout` picks the mode; each mode method returns the whole `StagingDecision`."""

    def __init__(
        self,
        pods: list[StagingPod],
        *,
        policy: StagingRollout,
        previous: StagingRolloutStatus,
        now: datetime,
        stale_after_s: float,
        good: AgentStaging,
    ) -> None:
        self.pods = pods
        self.good = good
        self.policy = policy
        self.previous = previous
        self.now = now
        self.stale_after_s = stale_after_s

    # -- modes ---------------------------------------------------------------------------

    def forward(
        self, source: AgentStaging, target: AgentStaging, *, started_at: datetime,
        starting: bool,
    ) -> StagingDecision:
        writes = self.newcomers(source, target, forward=True)
        view = with_writes(self.pods, writes)
        events: list[StagingEvent] = []
        if starting:
            events.append(StagingEvent(
                EventType.NORMAL, StagingReason.STARTED,
                f"Rolling out {target} (from {source}) in batches of "
                f"{self.policy.max_unavailable}",
            ))
        if (not starting and self.previous.phase is RolloutPhase.COMPLETE
                and all(at_size(p, target) for p in view)):
            # Done: health is the TransferHealthy condition's business from here on.
            return self.finish(RolloutPhase.COMPLETE, source, target, started_at=started_at,
                               message=self.previous.message, writes=writes)
        # A pod resizing towards the target is waited for even where the rollout does not
        # change it (a mixed state left by an earlier rollout).
        batch = [p for p in view if p.spec == target and p.reported is not None and (
            p.is_resizing or (changes(p, source, target) and self._analysing(p)))]
        # The batch first (its failure is the likely one to name), then every pod already
        # updated: a step is taken only while all of them report fresh, healthy numbers.
        judged = batch + [p for p in view if p not in batch and p.spec == target
                          and p.reported is not None]
        failure = next((r for r in (self._failure(p, target) for p in judged) if r), None)
        if failure is not None:
            if self.policy.auto_rollback:
                events.append(StagingEvent(
                    EventType.WARNING, StagingReason.ROLLING_BACK,
                    f"{failure.message}{_ROLLING_BACK}{source}",
                ))
                return self.rollback(source, target, started_at=started_at, failure=failure,
                                     writes=writes, events=events)
            held = self.hold(source, target, started_at=started_at, failure=failure,
                             writes=writes)
            events.append(StagingEvent(EventType.WARNING, StagingReason.PAUSED,
                                       held.status.message))
            return StagingDecision(held.status, held.writes, tuple(events), held.applied_now)
        remaining = [p for p in view if not at_size(p, target)]
        if not batch and not remaining:
            if self.previous.phase is not RolloutPhase.COMPLETE or starting:
                events.append(StagingEvent(EventType.NORMAL, StagingReason.COMPLETE,
                                           f"Rolled out {target} to {len(view)} pods"))
            return self.finish(RolloutPhase.COMPLETE, source, target, started_at=started_at,
                               message=f"Rolled out {target}", writes=writes, events=events)
        if batch:
            names = pod_names(batch)
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
            if any(changes(p, source, target) for p in view if p.name in _pods(moves)):
                events.append(StagingEvent(EventType.NORMAL, StagingReason.BATCH, message))
            return self.finish(RolloutPhase.PROGRESSING, source, target, started_at=started_at,
                               message=message, writes=writes + moves, events=events)
        confirming = [p for p in view if p.spec == target and p.is_pending]
        if confirming:
            return self.finish(RolloutPhase.PROGRESSING, source, target, started_at=started_at,
                               message=f"Waiting for {pod_names(confirming)} to confirm {target} "
                               "(size in force unchanged)", writes=writes, events=events)
        return self.finish(RolloutPhase.PROGRESSING, source, target, started_at=started_at,
                           message=self._blocked_message(view, target), writes=writes,
                           events=events)

    def rollback(
        self, rollout_from: AgentStaging, rollout_to: AgentStaging, *, started_at: datetime,
        failure: Failure, writes: tuple[SpecWrite, ...] | None = None,
        events: list[StagingEvent] | None = None,
    ) -> StagingDecision:
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
        view = with_writes(self.pods, writes)
        remaining = [p for p in view if not at_size(p, rollout_from)]
        if not remaining:
            message = f"{failure.message}{_ROLLED_BACK}{rollout_from}"
            if self.previous.phase is not RolloutPhase.ROLLED_BACK:
                events.append(StagingEvent(EventType.WARNING, StagingReason.ROLLED_BACK,
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

    def hold(self, source: AgentStaging, target: AgentStaging, *, started_at: datetime,
             failure: Failure, writes: tuple[SpecWrite, ...] | None = None) -> StagingDecision:
        """Paused where every pod is; only newcomers get a size."""
        if writes is None:
            writes = self.newcomers(source, target, forward=True)
        message = f"{failure.message}{_PAUSED}{source} to roll back, or to a new size"
        return self.finish(RolloutPhase.PAUSED, source, target, started_at=started_at,
                           message=message, writes=writes, mode=RolloutMode.HOLD,
                           failure=failure)

    def refuse(self, desired: AgentStaging, good: AgentStaging,
               minimum: AgentStaging) -> StagingDecision:
        """Paused without a `to`: nothing of a refused size is recorded, so a later spec (or a
        smaller chunk that lowers the minimum) starts a rollout normally."""
        message = (
            f"Refusing {desired}: one prefill chunk needs at least "
            f"decodePoolMiB={minimum.decode_pool_mib} and "
            f"prefillBufferMiB={minimum.prefill_buffer_mib}; pods keep their sizes"
        )
        events: list[StagingEvent] = []
        if self.previous.message != message:
            events.append(StagingEvent(EventType.WARNING, StagingReason.REFUSED, message))
        return self.finish(RolloutPhase.PAUSED, good, None, started_at=None, message=message,
                           writes=self.newcomers(good, good, forward=True), events=events,
                           mode=None)

    def finish(
        self, phase: RolloutPhase, source: AgentStaging | None, target: AgentStaging | None,
        *, started_at: datetime | None, message: str, writes: tuple[SpecWrite, ...],
        events: Iterable[StagingEvent] = (), mode: RolloutMode | None = RolloutMode.FORWARD,
        failure: Failure | None = None,
    ) -> StagingDecision:
        view = with_writes(self.pods, writes)
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
        return StagingDecision(status, writes, tuple(events), applied_now)

    # -- pieces --------------------------------------------------------------------------

    def newcomers(self, source: AgentStaging, target: AgentStaging, *,
                  forward: bool) -> tuple[SpecWrite, ...]:
        """Initial spec sizes for pods without a TransferAgent spec (module docstring)."""
        writes: list[SpecWrite] = []
        updated = set(self.previous.updated_pods)
        # Prefill limits first, checked against the rings in place; a new decode pod then
        # takes a ring that fits every limit, the new ones included.
        for pod in sorted((p for p in self.pods if p.spec is None),
                          key=lambda p: (p.role is not Role.PREFILL, natural_order(p.name))):
            preferred = target if forward and pod.name in updated else self.good
            view = with_writes(self.pods, tuple(writes))
            # After a rollout changed mid-way, neither end may fit: then a size already in
            # the fleet does (the largest ring for a decode pod, the smallest limit for a
            # prefill pod), and the pod is moved on from there like any other.
            seen = sorted({s for p in view for s in (p.spec, p.reported) if s is not None},
                          key=size_order, reverse=pod.role is Role.DECODE)
            choice = next((size for size in (preferred, self.good, source, target, *seen)
                           if ring_violation(with_writes(view, (SpecWrite(pod.name, size),)))
                           <= ring_violation(view)), preferred)
            writes.append(SpecWrite(pod.name, choice))
        return tuple(writes)

    def _moves(self, view: list[StagingPod], source: AgentStaging, target: AgentStaging, *,
               limit: int, retarget: bool = False) -> tuple[SpecWrite, ...]:
        """Up to `limit` new resizes towards `target` (re-targeting an already resizing pod
        is free when `retarget`), in order, each keeping the ring rule and the resizing
        count ≤ maxUnavailable."""
        grows = target.decode_pool_mib > source.decode_pool_mib

        def order(p: StagingPod) -> tuple[bool, bool, tuple[object, ...]]:
            first = Role.DECODE if grows else Role.PREFILL
            return (tightens(p, target), p.role is not first, natural_order(p.name))

        candidates = sorted(
            (p for p in view if p.reported is not None and p.spec != target
             and (retarget or not p.is_resizing)),
            key=order,
        )
        moves: list[SpecWrite] = []
        for pod in candidates:
            current = with_writes(view, tuple(moves))
            trial = with_writes(current, (SpecWrite(pod.name, target),))
            added = sum(p.is_resizing for p in trial) - sum(p.is_resizing for p in current)
            if added > 0 and limit <= 0:
                continue
            if ring_violation(trial) > ring_violation(current):
                continue
            if sum(p.is_resizing for p in trial) > self.policy.max_unavailable:
                continue
            moves.append(SpecWrite(pod.name, target))
            limit -= max(added, 0)
        return tuple(moves)

    def _analysing(self, pod: StagingPod) -> bool:
        since = pod.applied_at or self.now
        return since + timedelta(seconds=self.policy.analysis_seconds) > self.now

    def _failure(self, pod: StagingPod, target: AgentStaging) -> Failure | None:
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

    def _blocked_message(self, view: list[StagingPod], target: AgentStaging) -> str:
        silent = [p for p in view if p.reported is None and not at_size(p, target)]
        if silent:
            return f"Waiting for {pod_names(silent)} to report before resizing"
        return (f"Waiting: resizing {pod_names([p for p in view if not at_size(p, target)])} now "
                "would let a prefill chunk limit exceed a decode ring")



def _pods(writes: Iterable[SpecWrite]) -> set[str]:
    return {w.pod for w in writes}


def _moves_message(view: Sequence[StagingPod], moves: Sequence[SpecWrite],
                   source: AgentStaging, target: AgentStaging) -> str:
    """"Resizing <changed pods> to <target>", naming apart the pods whose spec only follows
    (their size in force does not change)."""
    moved = _pods(moves)
    resized = [p.name for p in view if p.name in moved and changes(p, source, target)]
    along = [p.name for p in view if p.name in moved and not changes(p, source, target)]
    parts = [f"Resizing {', '.join(resized)} to {target}"] if resized else []
    if along:
        parts.append(f"Writing {target} to {', '.join(along)} (size in force unchanged)")
    return "; ".join(parts)


def _summary(phase: RolloutPhase, source: AgentStaging | None, target: AgentStaging | None,
             pods: Sequence[StagingPod], *, rolling_back: bool) -> str:
    """The STAGING printer column: `4096MiB`, or `4096→6144MiB 2/4` while moving."""
    def arrow(a: AgentStaging, b: AgentStaging) -> str:
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
        back = sum(at_size(p, source) for p in pods)
        return f"{arrow(target, source)} {back}/{len(pods)} RollingBack"
    done = sum(at_size(p, target) for p in pods)
    suffix = " Paused" if phase is RolloutPhase.PAUSED else ""
    return f"{arrow(source, target)} {done}/{len(pods)}{suffix}"
