"""What the planner observes of each engine pod, and the arithmetic on those observations.

A pod's sizes are `AgentStaging` values, the contract's one shape of a staging size: what its
TransferAgent spec asks for and what its report says is in force. The size a pod's role
allocates (its *effective* size, the package docstring's term) is `AgentStaging.mib_for`,
the same answer the pod's agent uses to decide between a resize and a confirmation. The
helpers below are pure functions of a list of pods (the planner's *view*), shared by the
modes (`modes.py`) and the entry point (`plan.py`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from pd_contract.transferagent import AgentStaging, Role
from pd_operator.staging_rollout.decision import SpecWrite
from pd_operator.status.fleet import PodObservation

__all__ = [
    "PodHealth",
    "StagingPod",
    "at_size",
    "changes",
    "natural_order",
    "observe_pod",
    "pod_names",
    "ring_violation",
    "size_order",
    "tightens",
    "with_writes",
]


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
class StagingPod:
    """What the planner observes of one engine pod.

    `spec` is the size its TransferAgent spec asks for (None: no TransferAgent spec yet);
    `reported` the size its current incarnation reports in force (None: no report yet, or only
    a predecessor's). `written_at` and `applied_at`: see the package docstring.
    """

    name: str
    role: Role
    uid: str
    spec: AgentStaging | None
    reported: AgentStaging | None
    resizing: bool = False
    health: PodHealth = PodHealth()
    written_at: datetime | None = None
    applied_at: datetime | None = None

    @property
    def is_resizing(self) -> bool:
        if self.reported is None:
            return False
        if self.spec is None or self.resizing:
            return True
        return self.spec.mib_for(self.role) != self.reported.mib_for(self.role)

    @property
    def is_pending(self) -> bool:
        """Reported, and its report not yet its spec: resizing or confirming."""
        return self.reported is not None and (self.spec != self.reported or self.resizing)

    def settled_at(self, size: AgentStaging) -> bool:
        """Spec and report both `size`, and no resize under way."""
        return self.spec == size and self.reported == size and not self.resizing


def observe_pod(
    pod: PodObservation, *, written_at: datetime | None = None,
    applied_at: datetime | None = None,
) -> StagingPod:
    """A `StagingPod` from one pod of the fleet observation. Its report is the fleet's: a
    report written by another incarnation (a StatefulSet pod recreated under the same name)
    is no report, so the new pod is never judged by its predecessor's numbers."""
    spec = pod.agent.spec if pod.agent is not None else None
    report = pod.report
    return StagingPod(
        name=pod.name,
        role=pod.role,
        uid=pod.uid,
        spec=spec.staging if spec is not None else None,
        reported=report.staging if report is not None else None,
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


def at_size(pod: StagingPod, size: AgentStaging) -> bool:
    """`pod` needs nothing more to run `size`: settled at it, or not reporting yet with its
    spec already `size` (nothing to resize until it reports)."""
    if pod.reported is None:
        return pod.spec == size
    return pod.settled_at(size)


def changes(pod: StagingPod, source: AgentStaging, target: AgentStaging) -> bool:
    """Whether a rollout from `source` to `target` changes what `pod` allocates."""
    return source.mib_for(pod.role) != target.mib_for(pod.role)


def with_writes(pods: Iterable[StagingPod], writes: Iterable[SpecWrite]) -> list[StagingPod]:
    """`pods` as they are once `writes` set their specs (the planner's view after a step)."""
    sizes = {w.pod: w.size for w in writes}
    return [
        StagingPod(p.name, p.role, p.uid, sizes[p.name], p.reported, p.resizing, p.health,
                   p.written_at, p.applied_at) if p.name in sizes else p
        for p in pods
    ]


def ring_violation(pods: Iterable[StagingPod]) -> int:
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


def tightens(pod: StagingPod, target: AgentStaging) -> bool:
    """Whether moving `pod` to `target` shrinks a ring or grows a chunk limit."""
    current = pod.reported or pod.spec
    if current is None:
        return False
    if pod.role is Role.DECODE:
        return target.decode_pool_mib < current.decode_pool_mib
    return target.decode_pool_mib > current.decode_pool_mib


def size_order(size: AgentStaging) -> tuple[int, int]:
    """Sort key of sizes: by decode pool, then prefill buffer (deterministic picks)."""
    return (size.decode_pool_mib, size.prefill_buffer_mib)


def pod_names(pods: Iterable[StagingPod]) -> str:
    return ", ".join(p.name for p in pods)


def natural_order(name: str) -> tuple[object, ...]:
    """Sort key that puts decode-2 before decode-10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))
