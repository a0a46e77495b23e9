"""`plan_rollout`: the next rollout step for the observed pods, from the stored status.

It reads back what the status records (from/to, `startedAt`, `mode`, the rollback reason),
picks the mode and lets a `RolloutPass` (`modes.py`) compute the decision. The algorithm is in
the package docstring.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from typing import Final

from pd_contract.transferagent import AgentStaging
from pd_operator.api.sizing import compute_staging_footprint
from pd_operator.api.spec import PDDeploymentSpec
from pd_operator.api.status import (
    RollbackReason,
    RolloutMode,
    RolloutPhase,
    StagingRolloutStatus,
)
from pd_operator.api.transfer_spec import StagingRollout
from pd_operator.staging_rollout.decision import Failure, StagingDecision
from pd_operator.staging_rollout.planner.modes import RolloutPass
from pd_operator.staging_rollout.pods import (
    StagingPod,
    at_size,
    natural_order,
    size_order,
    with_writes,
)

__all__ = ["compute_minimum_staging", "plan_rollout"]

# What a stored stop without its sentence (a hand-edited status) is called.
_UNSAID: Final = "rollback requested"


def compute_minimum_staging(spec: PDDeploymentSpec) -> AgentStaging:
    """The smallest sizes that hold one prefill chunk: the floor `plan_rollout` refuses below."""
    footprint = compute_staging_footprint(spec)
    return AgentStaging(decode_pool_mib=footprint.min_decode_pool_mib,
                        prefill_buffer_mib=footprint.min_prefill_buffer_mib)


def plan_rollout(
    desired: AgentStaging,
    last_good: AgentStaging | None,
    pods: Sequence[StagingPod],
    *,
    policy: StagingRollout,
    previous: StagingRolloutStatus,
    now: datetime,
    stale_after_s: float,
    minimum: AgentStaging | None = None,
) -> StagingDecision:
    """The next rollout step for `pods` towards `desired` (see the package docstring).

    `last_good` is the size that last rolled out completely; None derives it from `previous`
    (or, with no record at all, from what most pods' specs ask for). `minimum`, normally
    `compute_minimum_staging(spec)` when staging is in use, is the floor below which no
    rollout starts. `stale_after_s` is `spec.transfer.health.staleAfterSeconds`.
    """
    pods = sorted(pods, key=lambda p: natural_order(p.name))
    good = last_good or _derive_last_good(previous, pods, desired)
    prev_from, prev_to = _sizes(previous)
    ctx = RolloutPass(pods, policy=policy, previous=previous, now=now,
                      stale_after_s=stale_after_s, good=good)

    if minimum is not None and (
        desired.decode_pool_mib < minimum.decode_pool_mib
        or desired.prefill_buffer_mib < minimum.prefill_buffer_mib
    ):
        return ctx.refuse(desired, good, minimum)
    if prev_to != desired or prev_from is None:
        initial = ctx.newcomers(good, desired, forward=True)
        if all(at_size(p, desired) for p in with_writes(pods, initial)):
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


def _sizes(status: StagingRolloutStatus) -> tuple[AgentStaging | None, AgentStaging | None]:
    """The from/to sizes the status records. A pair with a size missing, or below the 1 MiB
    every staging size has (only a hand-edited status holds one), records no size."""
    def size(pool: int | None, buffer: int | None) -> AgentStaging | None:
        if pool is None or buffer is None or pool < 1 or buffer < 1:
            return None
        return AgentStaging(decode_pool_mib=pool, prefill_buffer_mib=buffer)

    return (size(status.from_decode_pool_mib, status.from_prefill_buffer_mib),
            size(status.to_decode_pool_mib, status.to_prefill_buffer_mib))


def _derive_last_good(previous: StagingRolloutStatus, pods: Sequence[StagingPod],
                      desired: AgentStaging) -> AgentStaging:
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
    return min((size for size, count in specs.items() if count == top), key=size_order)
