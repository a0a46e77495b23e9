"""Each role's scale target (`PDRole`) and the PDDeployment's count of that role, kept equal.

A reconcile of a valid PDDeployment first calls `RoleScales.sync_counts`: it creates a
missing PDRole (with the PDDeployment's count), and carries a count edited on either side
to the other (`decide`, pure; `api/role_scale.py` says which side wins). When it patched
the PDDeployment's spec, the reconcile stops there: that patch's own event brings the next
one, which builds the workloads from the new count. After the status write,
`RoleScales.write_status` gives each PDRole the role's pod counts, its pod selector (what
an HPA reads through `/scale`) and the generation it has carried over.

Restart-safe at every step: a count carried over but not yet acknowledged in the PDRole's
`status.observedGeneration` is found equal on both sides next time, and only acknowledged.
The PDDeployment patch is conditional on the resourceVersion this reconcile read, so an
edit made meanwhile is never overwritten unseen (409: the work queue retries).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pd_contract.api import API_VERSION
from pd_operator.api import PDDeployment, PDDeploymentStatus, Role
from pd_operator.api.role_scale import PDRole, PDRoleStatus
from pd_operator.build.meta import object_meta
from pd_operator.build.names import LABEL_DEPLOYMENT, role_workload
from pd_operator.engines import role_spec
from pd_operator.kube import PDDEPLOYMENTS, PDROLES, KubeClient

__all__ = ["RoleScales", "ScaleDecision", "decide"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]


@dataclass(frozen=True)
class ScaleDecision:
    """What one role's counts need: the PDDeployment's count set to `deployment_replicas`,
    or the PDRole's to `target_replicas` (at most one of them), and why."""

    deployment_replicas: int | None = None
    target_replicas: int | None = None
    message: str = ""


def decide(role: Role, deployment_replicas: int, target: Mapping[str, Any]) -> ScaleDecision:
    """The edit not yet carried over wins; the PDRole's when both are new."""
    name = target["metadata"]["name"]
    wanted = int(target["spec"]["replicas"])
    generation = int(target["metadata"].get("generation", 0))
    observed = int((target.get("status") or {}).get("observedGeneration", 0))
    if wanted == deployment_replicas:
        return ScaleDecision()
    if generation > observed:
        return ScaleDecision(
            deployment_replicas=wanted,
            message=f"spec.{role.value}.replicas set to {wanted} (was {deployment_replicas}) "
                    f"from PDRole {name}, generation {generation}")
    return ScaleDecision(
        target_replicas=deployment_replicas,
        message=f"spec.replicas set to {deployment_replicas} (was {wanted}) from the "
                f"PDDeployment's spec.{role.value}.replicas")


class RoleScales:
    """The PDRoles' I/O for the reconciler; one per operator process."""

    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube
        # What the last sync did per PDRole (namespace, name), for its status message.
        self._messages: dict[tuple[str, str], str] = {}

    def sync_counts(self, pdd: PDDeployment,
                    cached: Sequence[Obj] | None = None) -> dict[Role, Obj] | None:
        """Create missing PDRoles and carry edited counts over. None when the PDDeployment's
        spec was patched (this reconcile should end: its event follows); else the PDRoles
        as they now stand (for `write_status`; one just created is left out). `cached`:
        the PDRoles labelled with the PDDeployment from the operator's cache, else listed."""
        meta = pdd.metadata
        targets: dict[Role, Obj] = {}
        found = cached if cached is not None else self.kube.list_objects(
            PDROLES, meta.namespace, f"{LABEL_DEPLOYMENT}={meta.name}")
        listed = {obj["metadata"]["name"]: obj for obj in found}
        for role in (Role.PREFILL, Role.DECODE):
            count = role_spec(pdd, role).replicas
            target = self._target(pdd, role, listed.get(role_workload(meta.name, role)))
            if target is None:
                continue  # just created with the PDDeployment's count
            decision = decide(role, count, target)
            key = (meta.namespace, target["metadata"]["name"])
            if decision.deployment_replicas is not None:
                self.kube.merge_patch(PDDEPLOYMENTS, meta.namespace, meta.name, {
                    "metadata": {"resourceVersion": meta.resource_version},
                    "spec": {role.value: {"replicas": decision.deployment_replicas}}})
                self._messages[key] = decision.message
                log.info("%s/%s: %s", meta.namespace, meta.name, decision.message)
                return None
            if decision.target_replicas is not None:
                target = self.kube.merge_patch(PDROLES, *key, {
                    "spec": {"replicas": decision.target_replicas}}) or target
                self._messages[key] = decision.message
                log.info("%s/%s: %s", *key, decision.message)
            targets[role] = target
        return targets

    def write_status(self, pdd: PDDeployment, status: PDDeploymentStatus,
                     targets: Mapping[Role, Obj]) -> None:
        """Each PDRole's status from the PDDeployment's, where it differs."""
        namespace = pdd.metadata.namespace
        for role, target in targets.items():
            name = target["metadata"]["name"]
            counts = status.prefill if role is Role.PREFILL else status.decode
            previous = target.get("status") or {}
            wanted = PDRoleStatus(
                replicas=counts.replicas, ready_replicas=counts.ready_replicas,
                selector=counts.selector,
                deployment_replicas=role_spec(pdd, role).replicas,
                observed_generation=int(target["metadata"].get("generation", 0)),
                message=self._messages.get((namespace, name), previous.get("message", "")),
            ).to_wire()
            if wanted != previous:
                self.kube.replace_status(target, wanted)

    def forget(self, namespace: str, name: str) -> None:
        """The PDDeployment ``name`` is gone: drop what was kept for its PDRoles."""
        for role in (Role.PREFILL, Role.DECODE):
            self._messages.pop((namespace, role_workload(name, role)), None)

    def _target(self, pdd: PDDeployment, role: Role, listed: Obj | None) -> Obj | None:
        """The role's PDRole (``listed``: as the list by the deployment's label found it),
        or None after creating it. One whose role or PDDeployment was edited to another gets
        its own back; one whose label was edited away is read by its name."""
        name = role_workload(pdd.metadata.name, role)
        own = {"pdDeployment": pdd.metadata.name, "role": role.value}
        target = listed if listed is not None else self.kube.get(
            PDROLES, pdd.metadata.namespace, name)
        if target is None:
            self.kube.create({
                "apiVersion": API_VERSION, "kind": PDRole.kind_name,
                "metadata": object_meta(pdd, name, role.value),
                "spec": {**own, "replicas": role_spec(pdd, role).replicas},
            })
            return None
        spec = target.get("spec") or {}
        if {k: spec.get(k) for k in own} != own:
            patched = self.kube.merge_patch(PDROLES, pdd.metadata.namespace, name,
                                            {"spec": own})
            return patched if patched is not None else target
        return target
