"""`status.rollout` of a PDDeployment: a change of the engine pods' template on its way, per
role and revision (the staging pool's own rollout is `status.stagingRollout`)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from pd_contract.api import APIModel

__all__ = ["EngineRolloutPhase", "EngineRolloutStatus", "RevisionCount", "RoleRollout"]


class EngineRolloutPhase(StrEnum):
    IDLE = "Idle"  # every pod runs the spec's template; no rollout has happened yet
    PROGRESSING = "Progressing"
    CANARY = "Canary"  # holding with the canary pods under analysis
    PAUSED = "Paused"  # spec.rollout.paused
    BLOCKED = "Blocked"  # no step can keep a compatible pair serving (see message)
    ROLLING_BACK = "RollingBack"  # a failed revision is being replaced by the last good one
    ROLLED_BACK = "RolledBack"  # back on the last good revision; the spec's is refused
    COMPLETE = "Complete"


class RevisionCount(APIModel):
    """The engine instances (pods) of one role at one revision."""

    revision: str = Field(description="The pod template hash (label pd.serving.dev/template-hash).")
    kv_compat: str = Field(default="", alias="kvCompat",
                           description="Their KV-compatibility key.")
    pods: int = Field(default=0, ge=0, description="Pods that exist, draining ones included.")
    ready: int = Field(default=0, ge=0, description="Ready pods, not draining.")
    draining: int = Field(default=0, ge=0, description="Pods being deleted (draining).")


class RoleRollout(APIModel):
    """One role in a rollout."""

    role: str = Field(description="prefill or decode.")
    to_revision: str = Field(default="", description="The revision being rolled out.")
    desired: int = Field(default=0, ge=0, description="The role's replicas.")
    surge: int = Field(default=0, ge=0,
                       description="Instances above the role's replicas now (surge, draining).")
    replacing: list[str] = Field(
        default_factory=list,
        description="Instances whose pod was deleted or failed while the role needed it: "
        "each is created again under the same name once its old pod is gone.")
    revisions: list[RevisionCount] = Field(
        default_factory=list, description="Pods per revision, the target's first.")


class EngineRolloutStatus(APIModel):
    """Progress of a pod-template rollout over both roles."""

    phase: EngineRolloutPhase = Field(default=EngineRolloutPhase.IDLE, description="Phase.")
    strategy: str = Field(default="", description="spec.rollout.strategy in force.")
    roles: list[RoleRollout] = Field(default_factory=list, description="Per role.")
    key_changed: bool = Field(
        default=False,
        description="The target's KV-compatibility key differs from the old pods': old and "
        "new pods cannot pair, so each key needs a pair of its own.")
    started_at: datetime | None = Field(default=None,
                                        description="When the current target was first seen.")
    stable_revisions: dict[str, str] = Field(
        default_factory=dict,
        description="Per role, the revision every pod ran when the last rollout settled: "
        "what a failed rollout returns to.")
    failed_revisions: dict[str, str] = Field(
        default_factory=dict,
        description="Per role, the revision that failed and was rolled back: the spec's "
        "template stays refused while it renders to it.")
    canary_ready_at: datetime | None = Field(
        default=None, description="When every canary pod first served (its analysis runs "
        "from then).")
    canary_passed: bool = Field(default=False,
                                description="The canary step is over for this target.")
    reason: str = Field(default="", description="Why the phase is what it is, one word.")
    message: str = Field(default="", description="What is happening and what to do.")
    summary: str = Field(default="", description="Phase and progress, for `kubectl get`.")
