"""The reconcile's engine-instance half: each role's target template (the spec's, or the last
good one while the spec renders a failed revision), one planning pass
(`engine_rollout.steps.plan_revisions`) over the fleet, the instances it creates (with the
children, before the status write) and those it deletes (after it), and the previous
release's StatefulSets retired.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pd_contract.identity import Authority
from pd_contract.names import LABEL_KV_COMPAT
from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.api.revision_status import EngineRolloutStatus
from pd_operator.build.names import LABEL_TEMPLATE_HASH
from pd_operator.build.pod import build_pod_template
from pd_operator.engine_rollout.executor import InstanceExecutor, publish_phase
from pd_operator.engine_rollout.planner import ROLES, EngineStep
from pd_operator.engine_rollout.pods import RoleTarget, observe_instances
from pd_operator.engine_rollout.steps import plan_revisions
from pd_operator.engines import engine_adapter, role_spec
from pd_operator.kube import KubeClient
from pd_operator.status import FleetObservation

__all__ = ["EngineRollouts", "RoleTemplates"]

Obj = dict[str, Any]

# How often each PDDeployment's identity Secrets are checked for ones without an instance.
IDENTITY_SWEEP_S: Final = 600.0


def _revision(template: Mapping[str, Any]) -> str:
    return str(template["metadata"]["labels"][LABEL_TEMPLATE_HASH])


@dataclass(frozen=True)
class RoleTemplates:
    """Per role: the spec's pod template, and the one new instances get."""

    spec: Mapping[Role, Obj]
    target: Mapping[Role, Obj]

    def revisions(self) -> dict[Role, str]:
        """The target revision per role."""
        return {r: _revision(t) for r, t in self.target.items()}

    def kv_compat(self, role: Role) -> str:
        return str(self.target[role]["metadata"]["labels"].get(LABEL_KV_COMPAT, ""))


class EngineRollouts:
    """One per operator process, used by each reconcile in three parts: `templates` and
    `plan` before the children are applied, `create` with them, `delete` after the status
    write."""

    def __init__(self, kube: KubeClient, clock: Callable[[], float] = time.monotonic) -> None:
        self.executor = InstanceExecutor(kube)
        self._clock = clock
        self._swept: dict[tuple[str, str], float] = {}  # per PDDeployment: the last sweep

    def templates(self, pdd: PDDeployment, agent_image: str,
                  previous: EngineRolloutStatus) -> RoleTemplates:
        """Each role's templates. While the spec renders a revision that failed a rollout,
        new instances get the last good revision's template, as recorded (read only then:
        the records are not cached)."""
        spec: dict[Role, Obj] = {}
        target: dict[Role, Obj] = {}
        for role in ROLES:
            spec[role] = target[role] = build_pod_template(pdd, role, agent_image)
            failed = previous.failed_revisions.get(role.value)
            good = previous.stable_revisions.get(role.value)
            if failed is None or good is None or good == failed:
                continue
            if _revision(spec[role]) == failed:
                kept = self.executor.kept_template(pdd, role, good)
                if kept is not None:
                    target[role] = kept
        return RoleTemplates(spec, target)

    @staticmethod
    def plan(pdd: PDDeployment, previous: EngineRolloutStatus, templates: RoleTemplates, *,
             fleet: FleetObservation) -> EngineStep:
        """One planning pass over the fleet."""
        targets = {role: RoleTarget(
            role=role, desired=role_spec(pdd, role).replicas,
            revision=_revision(templates.target[role]), kv_compat=templates.kv_compat(role),
            spec_revision=_revision(templates.spec[role])) for role in ROLES}
        pairs_by_key = pdd.spec.router.enabled and engine_adapter(pdd).router_reads_pods(pdd)
        instances = observe_instances(
            fleet, max_failure_ratio=pdd.spec.transfer.health.max_failure_ratio)
        step = plan_revisions(pdd.spec.rollout, previous, targets, instances, fleet.now,
                              name=pdd.metadata.name, pairs_by_key=pairs_by_key)
        if step.status.failed_revisions != previous.failed_revisions:
            # A new failure: the next pass plans on the good revision's template.
            step = EngineStep((), step.delete, step.status, step.events, 0.1)
        return step

    def create(self, pdd: PDDeployment, step: EngineStep, templates: RoleTemplates,
               live: Iterable[Obj], pods: Sequence[Obj], *,
               authority: Authority | None = None) -> list[str]:
        """Retire the previous release's StatefulSets (adopting their pods), then create the
        step's instances (with identities `authority` issues); `Pod/<name>` of each one
        created."""
        self.executor.retire_statefulsets(pdd, live)
        self.executor.adopt(pdd, pods)
        key, now = (pdd.metadata.namespace, pdd.metadata.name), self._clock()
        if authority is not None and now - self._swept.get(key, -IDENTITY_SWEEP_S) \
                >= IDENTITY_SWEEP_S:
            # A leader that stopped between an instance's pod and its identity Secret left
            # the Secret behind: the first pass of each process, and one in a while, sweeps.
            self._swept[key] = now
            self.executor.sweep_identities(
                pdd, {p["metadata"]["name"] for p in pods} | {x.name for x in step.create})
        created = self.executor.create(pdd, step, templates.target, authority)
        if any(e.reason in ("RolloutComplete", "RolledBack") for e in step.events):
            for role in ROLES:  # a rollout ended: the records of older revisions may go
                self.executor.prune(pdd, role, {
                    step.status.stable_revisions.get(role.value, ""),
                    _revision(templates.target[role])})
        return created

    def delete(self, namespace: str, name: str, step: EngineStep) -> None:
        self.executor.delete(namespace, name, step)

    def forget(self, namespace: str, name: str) -> None:
        self._swept.pop((namespace, name), None)
        publish_phase(namespace, name, None)
