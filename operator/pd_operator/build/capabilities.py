"""What the cluster serves, found by discovery, that changes which children are built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """Optional APIs the builders may use.

    `pod_disruption_budgets`: policy/v1 PodDisruptionBudget is served (Kubernetes 1.21+).
    """

    pod_disruption_budgets: bool = True
