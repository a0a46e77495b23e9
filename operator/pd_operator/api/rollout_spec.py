"""`spec.rollout` of a PDDeployment: how a change of the engine pods' template (image,
arguments, environment, model, page size, KV dtype...) replaces running engine instances."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from pd_contract.api import APIModel

__all__ = ["CanarySpec", "RolloutSpec", "RolloutStrategy"]


class RolloutStrategy(StrEnum):
    SURGE = "Surge"  # coordinated over both roles: new instances beside old, old leave drained
    ROLLING_UPDATE = "RollingUpdate"  # one instance of a role at a time, each role on its own
    RECREATE = "Recreate"  # every old instance of both roles at once


class CanarySpec(APIModel):
    """Stop after a few new-revision pods per role and judge them before the rest."""

    replicas: int = Field(
        default=1, ge=1, le=1000,
        description="New-revision pods per role that come up first (at most the role's "
        "replicas).",
    )
    analysis_seconds: int = Field(
        default=60, ge=0, le=86400,
        description="How long the canary pods must stay Ready and transfer-healthy before "
        "the rest of the rollout; a failure in that time rolls back.",
    )


class RolloutSpec(APIModel):
    """How a new pod template reaches the running engines of both roles."""

    strategy: RolloutStrategy = Field(
        default=RolloutStrategy.SURGE,
        description="Surge (default): new-revision engine instances start beside the old "
        "ones, each once; an old instance is deleted (and drains) only while each role keeps "
        "its replicas Ready and a prefill and a decode of one KV-compatibility key serve, "
        "the cheapest to lose first; a failing new revision rolls back by itself. "
        "RollingUpdate: each role replaces one instance at a time on its own (the old one "
        "drains and goes, then its replacement starts), no surge, no analysis. Recreate: "
        "every old instance of both roles is deleted at once (an outage), with the same "
        "analysis and rollback.",
    )
    max_surge: int = Field(
        default=1, ge=0, le=1000,
        description="Extra pods per role during a Surge rollout. 0 (no room for more GPUs) "
        "replaces a pod at a time in place, never the last Ready pod of a KV-compatible "
        "pair; a change of the KV-compatibility key then cannot proceed with one pod per "
        "role and says so.",
    )
    paused: bool = Field(
        default=False,
        description="Take no rollout step (no pod created for the rollout, none deleted) "
        "until cleared. Pods already starting come up.",
    )
    progress_deadline_seconds: int = Field(
        default=600, ge=10, le=86400,
        description="A new-revision pod not Ready this long after it was created fails the "
        "rollout, which rolls back.",
    )
    max_restarts: int = Field(
        default=2, ge=1, le=100,
        description="A new-revision pod whose engine restarted this many times fails the "
        "rollout (crash at start), which rolls back.",
    )
    canary: CanarySpec | None = Field(
        default=None,
        description="Bring up this many new-revision pods per role first and hold for the "
        "analysis; unset: no canary step.",
    )
