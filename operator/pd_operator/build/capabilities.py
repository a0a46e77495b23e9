"""What the cluster serves (found by discovery) and how this operator is installed: the facts
outside a PDDeployment that change which children are built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# The operator's own image: it holds `pd-transfer agent`, the sidecar of engine-native pods
# (no torch, no NIXL needed). The chart passes the image it installed (`--agent-image`).
DEFAULT_AGENT_IMAGE: Final = "ghcr.io/pd-operator/pd-operator:0.1.0"


@dataclass(frozen=True)
class Capabilities:
    """Optional APIs the builders may use, and the installation's own facts.

    `pod_disruption_budgets`: policy/v1 PodDisruptionBudget is served (Kubernetes 1.21+).
    `agent_image`: the image of the transfer-agent sidecar of engine-native pods.
    """

    pod_disruption_budgets: bool = True
    agent_image: str = DEFAULT_AGENT_IMAGE
