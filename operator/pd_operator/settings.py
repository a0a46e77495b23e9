"""Every kopf setting the operator changes, in one startup handler, each with its reason.

Values that come from the command line (`pd-operator run`) or a test are kept in
`OperatorConfig`, set by `configure()` before kopf starts; the startup handler in
`handlers.py` reads them when it assembles the reconciler.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, cast

import kopf

from pd_contract.api import GROUP, TRANSFERAGENT_PLURAL, VERSION
from pd_operator.build import DEFAULT_AGENT_IMAGE
from pd_operator.build.names import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGER
from pd_operator.leader import LeaseConfig
from pd_operator.workqueue import QueueTuning

__all__ = [
    "CHILD_RESOURCES",
    "TRANSFER_AGENT_RESOURCE",
    "NoDiffBase",
    "OperatorConfig",
    "configure",
    "configure_kopf",
    "current",
]

# (group, version, plural) of every kind the operator watches besides PDDeployments: each
# event of one of our children or pods maps to its PDDeployment through its labels.
CHILD_RESOURCES: tuple[tuple[str, str, str], ...] = (
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("", "v1", "configmaps"),
    ("", "v1", "secrets"),
    ("", "v1", "services"),
    ("apps", "v1", "statefulsets"),
    ("apps", "v1", "deployments"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("", "v1", "pods"),
)

# (group, version, plural) of TransferAgents: their events refresh their PDDeployment's status.
TRANSFER_AGENT_RESOURCE: tuple[str, str, str] = (GROUP, VERSION, TRANSFERAGENT_PLURAL)


@dataclass(frozen=True)
class OperatorConfig:
    """Runtime choices made outside kopf: API credentials, the work queue's timing, the
    image of the transfer-agent sidecar engine-native pods get, the leader election's Lease
    (None: this process is the only operator and always writes), and how long the process
    may take to exit once kopf has begun stopping (None: as long as kopf takes; the CLI sets
    it, an in-process test runner does not)."""

    kubeconfig: str | None = None
    tuning: QueueTuning = field(default_factory=QueueTuning)
    agent_image: str = DEFAULT_AGENT_IMAGE
    lease: LeaseConfig | None = None
    exit_grace_s: float | None = None


_config = OperatorConfig()


def configure(**changes: Any) -> OperatorConfig:
    """Replace fields of the process-wide OperatorConfig (before the operator starts)."""
    global _config  # noqa: PLW0603 - one config per process, set once by the CLI or a test
    _config = replace(_config, **changes)
    return _config


def current() -> OperatorConfig:
    return _config


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's change detection, turned off. For every watch event kopf deep-copies the
    object to diff it against the state its on.create/on.update handlers last handled; the
    operator registers none (only on.event handlers and indexers), so that copy, an eighth
    of the operator's CPU while a thousand PDDeployments are created, served nothing."""

    def build(self, *, body: kopf.Body,
              extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        return cast(kopf.BodyEssence, {})

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


@kopf.on.startup()
def configure_kopf(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Tune kopf for a level-based operator that writes nothing in steady state."""
    # Standalone, no kopf peering: replicas of equal priority would all freeze under it. Which
    # replica writes is decided by our own Lease (`leader.py`); every replica watches.
    settings.peering.standalone = True
    # kopf posts a k8s Event for every handler log line at INFO and above; our handlers only
    # enqueue keys, and the reconcile records its own Events after the status write. Keep
    # kopf's for warnings and errors (its own failures), so a steady state writes nothing.
    settings.posting.level = logging.WARNING
    # Watch streams can hang silently without a server-side timeout (kopf issues #204, #698):
    # ask the server to end each watch within 5 minutes, give the client a bit longer.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    # Watch only our own children and pods on the server side: a cluster's other pods never
    # reach the operator (less memory, CPU and API server load than client-side filters).
    for resource in CHILD_RESOURCES:
        settings.watching.label_selectors[resource] = f"{LABEL_MANAGED_BY}={MANAGER}"
    # TransferAgents are created by the pods' agents, not by us: select those that name
    # their PDDeployment (an existence selector), the one label every report must carry.
    settings.watching.label_selectors[TRANSFER_AGENT_RESOURCE] = LABEL_DEPLOYMENT
    # No dynamic scanning of CRDs and namespaces: the operator serves the namespaces it is
    # told to, and needs no list/watch permission on namespaces or CRDs.
    settings.scanning.disabled = True
    settings.persistence.diffbase_storage = NoDiffBase()
    # Batching of events per object is done by our work queue (coalescing per PDDeployment);
    # kopf's per-object workers only enqueue, so let them idle out quickly.
    settings.queueing.idle_timeout = 1.0
