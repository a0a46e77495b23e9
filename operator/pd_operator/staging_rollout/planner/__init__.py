"""The staging-pool rollout as pure arithmetic: observed pods in, the next step out.

`plan_rollout(desired, last_good, pods, *, policy, previous, now, stale_after_s)` returns a
`StagingDecision`: the new `status.stagingRollout`, the TransferAgent spec sizes to write now
(only changes) and the events to emit. It performs no I/O and reads no clock; the executor
makes the API calls (`rollout.executor`). Every step is derived from what the pods report, never
from memory, so a restarted operator computes the same step (lws `disaggregatedset/planner.go`).
A size is the contract's `AgentStaging` (decode pool and prefill buffer per rank, in MiB), the
same object the pods' agents read from their TransferAgent spec and report in force.

The status carries only what cannot be observed: the from/to pair, `startedAt`, the `mode`
(Forward, Hold or Rollback) and, once a batch failed analysis, `rollbackReason` (an
`api.status.RollbackReason`) with `rollbackMessage` (the failed pod and its numbers). The
planner reads these fields back and never parses `message`, which is for people. Two per-pod
times cannot be observed from a TransferAgent either and come in with each `StagingPod`: when
its spec size was written (`written_at`, stamped by the executor with each write) and since
when its report shows that size in force (`applied_at`; the executor stamps `now` for the pods
a decision lists in `applied_now`; `stamps.py`). A pod of which either time is unknown is
judged as if it happened now, which can only lengthen analysis and deadlines, never shorten
them.

Terms. A pod's *effective size* is the size its own role allocates (`AgentStaging.mib_for`): the
decode ring (decodePoolMiB) on decode pods, the prefill buffer (prefillBufferMiB) on prefill
pods, the same answer its agent uses to choose between a resize and a confirmation. A pod
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
`plan_step` plans only pods that have a TransferAgent: a pod without one is starting, and its
agent creates it with the sizes of the pod's ConfigMap (which sizes a starting pod then runs
is in the package README); there, a pod has no spec only when its TransferAgent's spec does
not parse.

Modules, in reading order: `plan.py` (`plan_rollout`, the mode from the stored status),
`modes.py` (`RolloutPass`: forward, rollback, hold, refuse), `pods.py` (`StagingPod`, what is
observed of a pod, and the ring rule's arithmetic), `decision.py` (what a pass returns),
`step.py` (the reconcile's planning half: the fleet observation to a `RolloutStep`, and when
to look again), `stamps.py` (the written-at and applied-at stamps, and the apply body that
carries a size). Nothing here does I/O: import-linter keeps kubernetes, kopf and nixl out.
"""

from pd_operator.staging_rollout.decision import (
    APPLY_GRACE_SECONDS,
    EventType,
    Failure,
    SpecWrite,
    StagingDecision,
    StagingEvent,
    StagingReason,
    apply_deadline_seconds,
)
from pd_operator.staging_rollout.planner.plan import compute_minimum_staging, plan_rollout
from pd_operator.staging_rollout.planner.stamps import (
    ANNOTATION_APPLIED_AT,
    ANNOTATION_WRITTEN_AT,
    format_stamp,
    parse_stamp,
    staging_apply,
)
from pd_operator.staging_rollout.planner.step import (
    MAX_RECHECK_S,
    RolloutStep,
    applied_stamps,
    plan_step,
    recheck_seconds,
    staging_pods,
)
from pd_operator.staging_rollout.pods import PodHealth, StagingPod, observe_pod

__all__ = [
    "ANNOTATION_APPLIED_AT",
    "ANNOTATION_WRITTEN_AT",
    "APPLY_GRACE_SECONDS",
    "MAX_RECHECK_S",
    "EventType",
    "Failure",
    "PodHealth",
    "RolloutStep",
    "SpecWrite",
    "StagingDecision",
    "StagingEvent",
    "StagingPod",
    "StagingReason",
    "applied_stamps",
    "apply_deadline_seconds",
    "compute_minimum_staging",
    "format_stamp",
    "observe_pod",
    "parse_stamp",
    "plan_rollout",
    "plan_step",
    "recheck_seconds",
    "staging_apply",
    "staging_pods",
]
