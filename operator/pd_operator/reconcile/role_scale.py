"""Each role's scale target (`PDRole`) and the PDDeployment's count of that role, kept equal.

A reconcile of a valid PDDeployment first calls `RoleScales.sync_counts`: it creates a
missing PDRole (with the PDDeployment's count), and carries a count edited on either side
to the other (`decide`, pure; `api/role_scale.py` says which side wins). When it patched
the PDDeployment's spec, the reconcile stops there: that patch's own event brings the next
one, which builds the workloads from the new count. After the status write,
`RoleScales.write_status` gives each PDRole the role's pod counts, its pod selector (what
an HPA reads through `/scale`) and the generation it has carried over.

Whose edit a PDRole's `spec.replicas` is: every write of the operator that sets it (the
create, the copy of the PDDeployment's count) records the same count, in the same write, in
the annotation `pd.serving.dev/operator-replicas`, and so does carrying the PDRole's count
over. The `/scale` subresource (kubectl scale, an HPA, KEDA) cannot change annotations: a
`spec.replicas` other than the annotation is someone else's edit, one equal to it is the
operator's own value, never an edit, acknowledged or not (a leader killed right after
creating a PDRole left generation 1 unacknowledged, and the next leader took that for an
edit newer than the PDDeployment's: `docs/failure-modes.md #53`). A PDRole without the
annotation (created by a release before it) is judged by its generation against
`status.observedGeneration`, and gets the annotation at the operator's next write of it
(at once where both counts agree).

Restart-safe at every step: the create and the copy write the count and its record in one
request; a PDRole's count carried into the PDDeployment is recorded right after that patch,
and an operator killed in between finds both counts equal next time and only records it.
The PDDeployment patch is conditional on the resourceVersion this reconcile read, and so is
the copy into a PDRole: an edit made meanwhile is never overwritten unseen (409: the work
queue retries).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pd_contract.api import API_VERSION
from pd_operator.api import PDDeployment, PDDeploymentStatus, Role
from pd_operator.api.role_scale import PDRole, PDRoleStatus
from pd_operator.build.meta import object_meta
from pd_operator.build.names import ANNOTATION_OPERATOR_REPLICAS, LABEL_DEPLOYMENT, role_workload
from pd_operator.engines import role_spec
from pd_operator.kube import PDDEPLOYMENTS, PDROLES, KubeClient

__all__ = ["RoleScales", "ScaleDecision", "decide", "recorded_replicas"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]


@dataclass(frozen=True)
class ScaleDecision:
    """What one role's counts need: the PDDeployment's count set to `deployment_replicas`,
    or the PDRole's to `target_replicas` (at most one of them), and why. `recorded`: the
    count to record in the PDRole's `pd.serving.dev/operator-replicas` (the one both sides
    hold once this is done): in the write of `target_replicas`, after the PDDeployment's
    patch, or alone where the counts agree but the record lags or is missing."""

    deployment_replicas: int | None = None
    target_replicas: int | None = None
    recorded: int | None = None
    message: str = ""


_COUNT = re.compile(r"[0-9]{1,9}")


def recorded_replicas(target: Mapping[str, Any]) -> int | None:
    """The count the operator last wrote into (or carried over from) the PDRole's
    spec.replicas, from its annotation; None without one (a PDRole of an earlier release),
    or when it is not a count."""
    annotations = (target.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(ANNOTATION_OPERATOR_REPLICAS)
    if not isinstance(value, str) or not _COUNT.fullmatch(value):
        return None
    return int(value)


def decide(role: Role, deployment_replicas: int, target: Mapping[str, Any]) -> ScaleDecision:
    """The edit not yet carried over wins; the PDRole's when both are new. The PDRole's
    count is an edit only where someone but the operator set it: it differs from the count
    the operator recorded, or, with none recorded, its generation is not acknowledged."""
    name = target["metadata"]["name"]
    wanted = int(target["spec"]["replicas"])
    generation = int(target["metadata"].get("generation", 0))
    recorded = recorded_replicas(target)
    if wanted == deployment_replicas:
        return ScaleDecision() if recorded == wanted else ScaleDecision(recorded=wanted)
    if recorded is not None:
        edited = wanted != recorded
    else:
        observed = int((target.get("status") or {}).get("observedGeneration", 0))
        edited = generation > observed
    if edited:
        return ScaleDecision(
            deployment_replicas=wanted, recorded=wanted,
            message=f"spec.{role.value}.replicas set to {wanted} (was {deployment_replicas}) "
                    f"from PDRole {name}, generation {generation}")
    return ScaleDecision(
        target_replicas=deployment_replicas, recorded=deployment_replicas,
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
                self._write_target(key, target, decision)  # carried over: recorded as such
                return None
            target = self._write_target(key, target, decision)
            if decision.target_replicas is not None:
                self._messages[key] = decision.message
                log.info("%s/%s: %s", *key, decision.message)
            targets[role] = target
        return targets

    def _write_target(self, key: tuple[str, str], target: Obj,
                      decision: ScaleDecision) -> Obj:
        """The PDRole's part of `decision` written (its count, conditional on the
        resourceVersion read, with the record of it; or the record alone); as it now is."""
        if decision.recorded is None:
            return target
        meta = target["metadata"]
        patch: Obj = {"metadata": {"annotations": {
            ANNOTATION_OPERATOR_REPLICAS: str(decision.recorded)}}}
        if decision.target_replicas is not None:
            if meta.get("resourceVersion"):
                patch["metadata"]["resourceVersion"] = meta["resourceVersion"]
            patch["spec"] = {"replicas": decision.target_replicas}
        return self.kube.merge_patch(PDROLES, *key, patch) or target

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
            replicas = role_spec(pdd, role).replicas
            self.kube.create({
                "apiVersion": API_VERSION, "kind": PDRole.kind_name,
                "metadata": {**object_meta(pdd, name, role.value), "annotations": {
                    ANNOTATION_OPERATOR_REPLICAS: str(replicas)}},
                "spec": {**own, "replicas": replicas},
            })
            return None
        spec = target.get("spec") or {}
        if {k: spec.get(k) for k in own} != own:
            patched = self.kube.merge_patch(PDROLES, pdd.metadata.namespace, name,
                                            {"spec": own})
            return patched if patched is not None else target
        return target
