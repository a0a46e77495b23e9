"""The engine-rollout planner (pd_operator.engine_rollout) stepped through whole rollouts on a
simulated fleet of instances: the operator creates and deletes each instance by name (nothing
recreates a deleted pod), instances take a few passes to become Ready, deletions drain for a
pass. After every pass the test asserts what the rollout promises: a KV-compatible
prefill/decode pair serves, each role keeps its serving instances (with surge room), at most
`max(1, maxSurge)` instances of a role drain, and no name is ever created twice while its pod
exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import pytest

from pd_contract.transferagent import Role
from pd_operator.api.revision_status import EngineRolloutPhase, EngineRolloutStatus
from pd_operator.api.rollout_spec import CanarySpec, RolloutSpec, RolloutStrategy
from pd_operator.api.transfer_spec import TransferHealthPolicy
from pd_operator.engine_rollout.planner import EngineStep, serving_counts
from pd_operator.engine_rollout.pods import Instance, RoleTarget, observe_instances
from pd_operator.engine_rollout.steps import plan_revisions
from pd_operator.status import observe_fleet
from pd_testbed.kube_factories import make_agent

T0 = datetime(2026, 11, 29, 8, 0, tzinfo=UTC)
ROLES = (Role.PREFILL, Role.DECODE)


@dataclass
class SimPod:
    name: str
    role: Role
    index: int | None  # None: a legacy StatefulSet pod
    revision: str
    key: str
    age: int = 0  # passes since created
    deleting_for: int | None = None  # passes since deletion began
    restarts: int = 0
    uid: int = 0
    requests: int | None = 0
    failed: bool = False

    def ready(self, start_passes: int, crashing: bool) -> bool:
        return not crashing and not self.failed and self.age >= start_passes


@dataclass
class SimRole:
    role: Role
    desired: int
    template: tuple[str, str]  # (revision, key) new instances get


@dataclass
class Fleet:
    """Both roles' instances; `crash` lists revisions whose engine exits at start, `hang`
    those that never become Ready."""

    spec: RolloutSpec
    roles: dict[Role, SimRole]
    pods: dict[str, SimPod] = field(default_factory=dict)
    start_passes: int = 3
    drain_passes: int = 1
    crash: set[str] = field(default_factory=set)
    hang: set[str] = field(default_factory=set)
    unready: set[str] = field(default_factory=set)  # instances (name@revision) not Ready now
    status: EngineRolloutStatus = field(default_factory=EngineRolloutStatus)
    now: datetime = T0
    created: list[str] = field(default_factory=list)
    deleted_old: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    history: list[tuple[str, str, str]] = field(default_factory=list)  # each pass's summary
    spec_template: dict[Role, tuple[str, str]] = field(default_factory=dict)
    last: EngineStep | None = None

    @classmethod
    def steady(cls, spec: RolloutSpec, prefill: int, decode: int, revision: str = "a",
               key: str = "k1", *, legacy: bool = False) -> Fleet:
        fleet = cls(spec, {})
        for role, n in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
            r = SimRole(role, n, (f"{role.value[0]}{revision}", key))
            fleet.roles[role] = r
            for i in range(n):
                name = (f"x-{role.value}-{i}" if legacy
                        else f"x-{role.value}-{r.template[0]}-{i}")
                fleet.pods[name] = SimPod(name, role, None if legacy else i, r.template[0],
                                          key, age=10, uid=len(fleet.pods))
        fleet.spec_template = {role: r.template for role, r in fleet.roles.items()}
        fleet.step()  # the settled first pass records the stable revisions
        return fleet

    def change(self, role: Role, revision: str, key: str | None = None) -> None:
        """The spec's template of `role` changes."""
        template = (f"{role.value[0]}{revision}", key or self.roles[role].template[1])
        self.spec_template[role] = template
        self.roles[role].template = template

    def instances(self) -> list[Instance]:
        out = []
        for pod in self.pods.values():
            crashing = pod.revision in self.crash
            out.append(Instance(
                name=pod.name, uid=f"{pod.name}-{pod.uid}", role=pod.role, index=pod.index,
                revision=pod.revision, kv_compat=pod.key,
                ready=pod.ready(self.start_passes, crashing) and pod.revision not in self.hang
                and f"{pod.name}@{pod.revision}" not in self.unready,
                deleting=pod.deleting_for is not None, restarts=pod.restarts,
                failed=pod.failed, requests=pod.requests,
                created_at=self.now - timedelta(seconds=5 * pod.age)))
        return out

    def targets(self) -> dict[Role, RoleTarget]:
        return {role: RoleTarget(role=role, desired=r.desired, revision=r.template[0],
                                 kv_compat=r.template[1],
                                 spec_revision=self.spec_template.get(role, r.template)[0])
                for role, r in self.roles.items()}

    def step(self) -> None:
        """One reconcile pass, then the world moves on by 5 s."""
        targets = self.targets()
        # what the reconcile does first: a role whose spec revision failed gets the last
        # good template (as pd_operator.reconcile.engine_rollout finds it recorded)
        for role, r in self.roles.items():
            failed = self.status.failed_revisions.get(role.value)
            if failed is not None and failed == targets[role].spec_revision:
                good = self.status.stable_revisions[role.value]
                key = next((p.key for p in self.pods.values() if p.revision == good),
                           r.template[1])
                r.template = (good, key)
                targets[role] = replace(targets[role], revision=good, kv_compat=key)
        step = plan_revisions(self.spec, self.status, targets, self.instances(), self.now,
                              name="x")
        self.last = step
        if step.status.failed_revisions != self.status.failed_revisions:
            step = replace(step, create=())  # as the reconcile glue: the next pass plans
        self.status = step.status
        self.events += [e.reason for e in step.events]
        self.messages += [e.message for e in step.events]
        self.history.append((step.status.phase.value, step.status.summary, step.status.reason))
        for new in step.create:
            assert new.name not in self.pods, f"{new.name} created while its pod exists"
            assert new.revision == self.roles[new.role].template[0]
            index = int(new.name.rsplit("-", 1)[-1])
            self.pods[new.name] = SimPod(new.name, new.role, index, new.revision,
                                         self.roles[new.role].template[1],
                                         uid=len(self.created) + 100)
            self.created.append(new.name)
        for pod in step.delete:
            sim = self.pods[pod.name]
            assert sim.deleting_for is None or sim.failed, f"{pod.name} deleted twice"
            sim.deleting_for = 0
            if not sim.failed:
                self.deleted_old.append(f"{pod.name}@{pod.revision}")
        self._world()
        self.now += timedelta(seconds=5)

    def _world(self) -> None:
        for name, pod in list(self.pods.items()):
            pod.age += 1
            if pod.revision in self.crash:
                pod.restarts += 1
            if pod.deleting_for is not None:
                pod.deleting_for += 1
                if pod.deleting_for > self.drain_passes:
                    del self.pods[name]

    def serving(self) -> dict[Role, int]:
        return serving_counts(self.instances())

    def revisions(self, role: Role) -> list[str]:
        return sorted(p.revision for p in self.pods.values() if p.role == role)

    def run(self, until: EngineRolloutPhase, passes: int = 80, *,
            floor: dict[Role, int] | None = None) -> int:
        """Step until the phase is `until`, checking the invariants after every pass."""
        for n in range(passes):
            self.step()
            serving = self.serving()
            assert min(serving.values()) >= 1, f"pass {n}: no compatible pair serves: {serving}"
            for role, least in (floor or {}).items():
                assert serving[role] >= least, f"pass {n}: {role.value} serves {serving}"
            for role, r in self.roles.items():
                mine = [p for p in self.pods.values() if p.role == role]
                draining = sum(1 for p in mine if p.deleting_for is not None)
                assert draining <= max(1, self.spec.max_surge)
                if self.spec.strategy is RolloutStrategy.SURGE:
                    assert len(mine) <= r.desired + self.spec.max_surge, (n, mine)
            if self.status.phase is until:
                return n
        raise AssertionError(f"not {until.value} after {passes} passes: {self.history[-5:]}")


def test_an_argument_change_surges_each_role_and_keeps_every_role_serving() -> None:
    fleet = Fleet.steady(RolloutSpec(), prefill=1, decode=1)
    assert fleet.status.phase is EngineRolloutPhase.IDLE
    assert fleet.status.stable_revisions == {"prefill": "pa", "decode": "da"}
    fleet.change(Role.PREFILL, "b")
    fleet.change(Role.DECODE, "b")
    fleet.run(EngineRolloutPhase.COMPLETE, floor={Role.PREFILL: 1, Role.DECODE: 1})
    assert fleet.revisions(Role.PREFILL) == ["pb"] and fleet.revisions(Role.DECODE) == ["db"]
    # each old instance deleted once, and no new one
    assert sorted(fleet.deleted_old) == ["x-decode-da-0@da", "x-prefill-pa-0@pa"]
    assert fleet.events[0] == "RolloutStarted" and fleet.events[-1] == "RolloutComplete"
    assert fleet.status.stable_revisions == {"prefill": "pb", "decode": "db"}
    assert fleet.status.summary == "Complete"
    # each new engine started exactly once
    assert fleet.created == ["x-prefill-pb-0", "x-decode-db-0"]


def test_a_key_change_never_pairs_across_keys_and_keeps_both_roles_at_their_replicas() -> None:
    fleet = Fleet.steady(RolloutSpec(), prefill=2, decode=2)
    fleet.change(Role.PREFILL, "b", key="k2")
    fleet.change(Role.DECODE, "b", key="k2")
    fleet.step()
    assert fleet.status.key_changed
    fleet.run(EngineRolloutPhase.COMPLETE, floor={Role.PREFILL: 2, Role.DECODE: 2})
    assert fleet.revisions(Role.PREFILL) == ["pb", "pb"]
    assert {p.kv_compat for p in fleet.instances()} == {"k2"}


def test_one_role_changing_leaves_the_other_alone() -> None:
    fleet = Fleet.steady(RolloutSpec(), prefill=2, decode=1)
    fleet.change(Role.DECODE, "b")
    fleet.run(EngineRolloutPhase.COMPLETE, floor={Role.PREFILL: 2, Role.DECODE: 1})
    assert fleet.revisions(Role.PREFILL) == ["pa", "pa"]
    assert all(name.startswith("x-decode") for name in fleet.deleted_old)


def test_an_engine_that_exits_at_start_rolls_back_without_touching_an_old_pod() -> None:
    fleet = Fleet.steady(RolloutSpec(max_restarts=2), prefill=1, decode=1)
    fleet.crash = {"pb", "db"}
    fleet.change(Role.PREFILL, "b")
    fleet.change(Role.DECODE, "b")
    fleet.run(EngineRolloutPhase.ROLLED_BACK, floor={Role.PREFILL: 1, Role.DECODE: 1})
    assert "RolloutFailed" in fleet.events and fleet.events[-1] == "RolledBack"
    # the old instances served throughout, and no engine of the good revision started again
    assert [d for d in fleet.deleted_old if d.endswith(("@pa", "@da"))] == []
    assert fleet.created == ["x-prefill-pb-0", "x-decode-db-0"]
    assert fleet.revisions(Role.PREFILL) == ["pa"] and fleet.revisions(Role.DECODE) == ["da"]
    assert fleet.status.failed_revisions == {"prefill": "pb", "decode": "db"}
    assert fleet.status.reason == "CrashLoop"
    assert "restarted 2 times" in fleet.status.message
    assert "rolled back to the last good revision" in fleet.status.message
    # the spec still renders the failed revision: it stays refused, the pods stay
    for _ in range(5):
        fleet.step()
    assert fleet.status.phase is EngineRolloutPhase.ROLLED_BACK
    assert fleet.revisions(Role.PREFILL) == ["pa"]
    # a fixed spec rolls forward again
    fleet.crash = set()
    fleet.change(Role.PREFILL, "c")
    fleet.change(Role.DECODE, "c")
    fleet.run(EngineRolloutPhase.COMPLETE)
    assert fleet.revisions(Role.PREFILL) == ["pc"] and fleet.status.failed_revisions == {}


def test_an_old_pod_that_is_not_ready_is_kept_until_a_new_pod_of_its_role_serves() -> None:
    """Guards against a bad revision costing a pod that was only briefly unready (its
    transfer gate False for one window): with room to surge, no old pod goes before a new
    pod of its role serves; a revision that exits at start deletes nothing."""
    fleet = Fleet.steady(RolloutSpec(max_restarts=2), prefill=2, decode=2)
    fleet.unready = {"x-decode-da-0@da"}
    fleet.crash = {"pb", "db"}
    fleet.change(Role.PREFILL, "b")
    fleet.change(Role.DECODE, "b")
    fleet.run(EngineRolloutPhase.ROLLING_BACK)
    fleet.unready = set()  # its window passed: Ready again
    fleet.run(EngineRolloutPhase.ROLLED_BACK)
    assert [d for d in fleet.deleted_old if d.endswith(("@pa", "@da"))] == []
    assert fleet.revisions(Role.DECODE) == ["da", "da"]
    # A revision that serves: the unready old instance is then the first of its role to go.
    fleet.unready = {"x-decode-da-0@da"}
    fleet.crash = set()
    fleet.change(Role.PREFILL, "c")
    fleet.change(Role.DECODE, "c")
    fleet.run(EngineRolloutPhase.COMPLETE, floor={Role.PREFILL: 2, Role.DECODE: 1})
    decodes = [d for d in fleet.deleted_old if d.startswith("x-decode") and d.endswith("@da")]
    assert decodes[0] == "x-decode-da-0@da", fleet.deleted_old


def test_a_pod_that_never_becomes_ready_rolls_back_at_the_progress_deadline() -> None:
    fleet = Fleet.steady(RolloutSpec(progress_deadline_seconds=60), prefill=2, decode=2)
    fleet.hang = {"pb"}
    fleet.change(Role.PREFILL, "b")
    fleet.run(EngineRolloutPhase.ROLLED_BACK, floor={Role.PREFILL: 2, Role.DECODE: 2})
    assert fleet.status.reason == "ProgressDeadlineExceeded"
    phases = [phase for phase, _, _ in fleet.history]
    failed_at = phases.index("RollingBack") - phases.index("Progressing")
    assert 60 / 5 <= failed_at <= 60 / 5 + 2  # the deadline from the surge pod's creation
    assert fleet.revisions(Role.PREFILL) == ["pa", "pa"]


def test_a_second_change_mid_rollout_rolls_forward_to_the_newest_and_leaves_no_other() -> None:
    fleet = Fleet.steady(RolloutSpec(), prefill=2, decode=2)
    fleet.change(Role.PREFILL, "b")
    fleet.change(Role.DECODE, "b")
    for _ in range(6):
        fleet.step()
    assert "pb" in fleet.revisions(Role.PREFILL)
    fleet.change(Role.PREFILL, "c")
    fleet.change(Role.DECODE, "c")
    fleet.run(EngineRolloutPhase.COMPLETE, floor={Role.PREFILL: 2, Role.DECODE: 2})
    assert fleet.revisions(Role.PREFILL) == ["pc", "pc"]
    assert fleet.revisions(Role.DECODE) == ["dc", "dc"]
    assert fleet.events.count("RolloutStarted") == 2


def test_without_surge_room_one_pod_per_role_is_blocked_and_says_what_to_do() -> None:
    fleet = Fleet.steady(RolloutSpec(max_surge=0), prefill=1, decode=1)
    fleet.change(Role.PREFILL, "b")
    fleet.run(EngineRolloutPhase.BLOCKED)
    assert fleet.deleted_old == [] and fleet.created == []
    assert "maxSurge" in fleet.status.message


def test_without_surge_room_two_per_role_replace_in_place_and_keep_a_pair() -> None:
    fleet = Fleet.steady(RolloutSpec(max_surge=0), prefill=2, decode=2)
    fleet.change(Role.PREFILL, "b", key="k2")
    fleet.change(Role.DECODE, "b", key="k2")
    fleet.run(EngineRolloutPhase.COMPLETE, floor={Role.PREFILL: 1, Role.DECODE: 1})
    assert len(fleet.created) == 4  # in place: no surge instance at all
    assert fleet.revisions(Role.DECODE) == ["db", "db"]


def test_paused_takes_no_step_and_resumes() -> None:
    fleet = Fleet.steady(RolloutSpec(paused=True), prefill=1, decode=1)
    fleet.change(Role.PREFILL, "b")
    for _ in range(5):
        fleet.step()
    assert fleet.status.phase is EngineRolloutPhase.PAUSED
    assert fleet.created == [] and fleet.deleted_old == []
    fleet.spec = RolloutSpec()
    fleet.run(EngineRolloutPhase.COMPLETE)
    assert fleet.revisions(Role.PREFILL) == ["pb"]


def test_a_canary_holds_for_its_analysis_then_goes_on() -> None:
    spec = RolloutSpec(canary=CanarySpec(replicas=1, analysis_seconds=30))
    fleet = Fleet.steady(spec, prefill=3, decode=3)
    fleet.change(Role.PREFILL, "b")
    fleet.change(Role.DECODE, "b")
    fleet.run(EngineRolloutPhase.CANARY)
    held = 0
    while fleet.status.phase is EngineRolloutPhase.CANARY:
        assert fleet.deleted_old == []
        fleet.step()
        held += 1
    assert held >= 30 / 5 and "CanaryPassed" in fleet.events
    fleet.run(EngineRolloutPhase.COMPLETE, floor={Role.PREFILL: 3, Role.DECODE: 3})
    assert fleet.revisions(Role.PREFILL) == ["pb", "pb", "pb"]


def test_recreate_deletes_every_old_pod_at_once() -> None:
    fleet = Fleet.steady(RolloutSpec(strategy=RolloutStrategy.RECREATE), prefill=2, decode=1)
    fleet.change(Role.PREFILL, "b")
    fleet.change(Role.DECODE, "b")
    fleet.step()
    assert sorted(fleet.deleted_old) == ["x-decode-da-0@da", "x-prefill-pa-0@pa",
                                         "x-prefill-pa-1@pa"]
    for _ in range(10):
        fleet.step()
    assert fleet.status.phase is EngineRolloutPhase.COMPLETE


def test_rolling_update_replaces_one_instance_at_a_time_without_surge() -> None:
    spec = RolloutSpec(strategy=RolloutStrategy.ROLLING_UPDATE)
    fleet = Fleet.steady(spec, prefill=2, decode=1)
    fleet.change(Role.PREFILL, "b")
    fleet.step()
    assert fleet.status.phase is EngineRolloutPhase.PROGRESSING
    assert fleet.status.reason == "RollingUpdate"
    for _ in range(40):
        fleet.step()
        assert sum(1 for p in fleet.pods.values() if p.role is Role.PREFILL) <= 2
        assert fleet.serving()[Role.PREFILL] >= 1
        if fleet.status.phase is EngineRolloutPhase.COMPLETE:
            break
    assert fleet.revisions(Role.PREFILL) == ["pb", "pb"]
    assert fleet.created == ["x-prefill-pb-0", "x-prefill-pb-1"]


@pytest.mark.parametrize("surge", [1, 2])
def test_the_status_counts_each_revision(surge: int) -> None:
    fleet = Fleet.steady(RolloutSpec(max_surge=surge), prefill=2, decode=2)
    fleet.change(Role.PREFILL, "b")
    fleet.step()
    fleet.step()  # the status shows the instances the first pass created
    prefill = next(r for r in fleet.status.roles if r.role == "prefill")
    assert prefill.to_revision == "pb" and prefill.desired == 2 and prefill.surge == surge
    assert [(c.revision, c.pods, c.ready) for c in prefill.revisions] == [("pb", surge, 0),
                                                                         ("pa", 2, 2)]
    assert fleet.status.summary == "Progressing 2/4"


def test_a_plain_scale_down_is_no_rollout_and_removes_the_idlest_instance() -> None:
    fleet = Fleet.steady(RolloutSpec(), prefill=1, decode=3)
    fleet.pods["x-decode-da-0"].requests = 3  # the one a highest-ordinal rule would keep
    fleet.pods["x-decode-da-2"].requests = 5
    fleet.pods["x-decode-da-1"].requests = 0
    fleet.roles[Role.DECODE].desired = 2
    for _ in range(4):
        fleet.step()
        assert fleet.status.phase is EngineRolloutPhase.IDLE
    assert fleet.events == ["DeletingInstance"]
    assert fleet.deleted_old == ["x-decode-da-1@da"]
    assert fleet.messages == [
        "decode 3 -> 2: deleting instance x-decode-da-1 (0 in flight, 0 B of KV waiting to "
        "be pulled), the cheapest to lose; kept: x-decode-da-0 (3 in flight, 0 B of KV "
        "waiting to be pulled), x-decode-da-2 (5 in flight, 0 B of KV waiting to be "
        "pulled)"]
    assert sorted(p.name for p in fleet.pods.values() if p.role is Role.DECODE) == [
        "x-decode-da-0", "x-decode-da-2"]


def test_a_key_change_behind_a_router_that_pairs_by_no_key_says_so() -> None:
    fleet = Fleet.steady(RolloutSpec(), prefill=1, decode=1)
    fleet.change(Role.PREFILL, "b", key="k2")
    fleet.change(Role.DECODE, "b", key="k2")
    targets = fleet.targets()
    step = plan_revisions(fleet.spec, fleet.status, targets, fleet.instances(), fleet.now,
                          name="x", pairs_by_key=False)
    assert step.status.key_changed
    assert step.status.message.endswith(
        "the router is not told the pods' keys: while both keys serve, a request can pair a "
        "prefill with a decode of the other key")
    paired = plan_revisions(fleet.spec, fleet.status, targets, fleet.instances(), fleet.now,
                            name="x")
    assert "router" not in paired.status.message


def _pod(role: Role, index: int, revision: str, key: str, **facts: object) -> Instance:
    fields: dict[str, object] = {"ready": True, "deleting": False, "created_at": T0}
    fields.update(facts)
    return Instance(name=f"x-{role.value}-{index}", uid=f"u-{role.value}-{index}",
                    role=role, index=index, revision=revision, kv_compat=key,
                    **fields)  # type: ignore[arg-type]


def _targets(prefill: tuple[str, str], decode: tuple[str, str]) -> dict[Role, RoleTarget]:
    return {role: RoleTarget(role=role, desired=1, revision=rev, kv_compat=key,
                             spec_revision=rev)
            for role, (rev, key) in ((Role.PREFILL, prefill), (Role.DECODE, decode))}


def test_a_failure_after_one_role_finished_rolls_back_every_role_the_rollout_moved() -> None:
    """Guards against a rollback of one role only: after a key change, the other role
    would keep the new key and no compatible pair would be left."""
    previous = EngineRolloutStatus(phase=EngineRolloutPhase.PROGRESSING, started_at=T0,
                                   stable_revisions={"prefill": "pa", "decode": "da"})
    pods = [_pod(Role.PREFILL, 0, "pb", "k2"),
            _pod(Role.DECODE, 0, "da", "k1"),
            _pod(Role.DECODE, 1, "db", "k2", ready=False, restarts=2)]
    step = plan_revisions(RolloutSpec(), previous, _targets(("pb", "k2"), ("db", "k2")), pods,
                          T0 + timedelta(seconds=30), name="x")
    assert step.status.phase is EngineRolloutPhase.ROLLING_BACK
    assert step.status.failed_revisions == {"prefill": "pb", "decode": "db"}
    assert step.delete == ()


def test_a_serving_new_pod_whose_engine_ends_requests_with_errors_rolls_back() -> None:
    """Guards against a revision that answers /health and moves KV but ends requests with a
    server error (vLLM's FINISHED_ERROR, HTTP 500) rolling on."""
    previous = EngineRolloutStatus(phase=EngineRolloutPhase.PROGRESSING, started_at=T0,
                                   stable_revisions={"prefill": "pa", "decode": "da"})
    later = T0 + timedelta(seconds=30)
    targets = _targets(("pa", "k1"), ("db", "k1"))
    erring = "4 of the 10 requests its engine ended in the last 60 s ended with a server error"
    pods = [_pod(Role.PREFILL, 0, "pa", "k1"), _pod(Role.DECODE, 0, "da", "k1"),
            _pod(Role.DECODE, 1, "db", "k1", ready=False, request_errors=erring)]
    # Not serving yet (its gate is False): no verdict on the revision.
    assert plan_revisions(RolloutSpec(), previous, targets, pods,
                          later, name="x").status.phase is EngineRolloutPhase.PROGRESSING
    failed = plan_revisions(RolloutSpec(), previous, targets,
                            [*pods[:2], replace(pods[2], ready=True)], later, name="x")
    assert failed.status.reason == "RequestErrors"
    assert failed.status.message.startswith(
        f"decode instance x-decode-1 (revision db): {erring}: rolling back")
    assert failed.status.failed_revisions == {"decode": "db"}


def test_transfers_are_judged_only_on_a_serving_pod_with_failures_of_its_own() -> None:
    """Guards against a rollback over an agent's first report of an engine still starting
    (it cannot read a rank yet: unhealthy with no transfer)."""
    previous = EngineRolloutStatus(phase=EngineRolloutPhase.PROGRESSING, started_at=T0,
                                   stable_revisions={"prefill": "pa", "decode": "da"})
    later = T0 + timedelta(seconds=30)
    targets = _targets(("pa", "k1"), ("db", "k1"))
    starting = [_pod(Role.PREFILL, 0, "pa", "k1"), _pod(Role.DECODE, 0, "da", "k1"),
                _pod(Role.DECODE, 1, "db", "k1", ready=False, transfer_failing=True)]
    held = plan_revisions(RolloutSpec(), previous, targets, starting, later, name="x")
    assert held.status.phase is EngineRolloutPhase.PROGRESSING
    serving = [*starting[:2], replace(starting[2], ready=True,
                                      transfer_detail="3 of 10 transfers failed.")]
    failed = plan_revisions(RolloutSpec(), previous, targets, serving, later, name="x")
    assert failed.status.reason == "TransferUnhealthy"
    assert failed.status.message.startswith(
        "decode instance x-decode-1 (revision db) reports its KV transfers failing: 3 of 10 "
        "transfers failed: rolling back")
    assert failed.status.failed_revisions == {"decode": "db"}


@pytest.mark.parametrize(("requests", "errors", "peer_caused", "judged"), [
    (10, 4, 0, 4),   # 40% > the 5% limit
    (100, 5, 0, 0),  # 5%: at the limit, not above it
    (10, 4, 3, 1),   # 3 loads failed as their prefill went away: 1 of 10 is the pod's own
    (10, 4, 4, 0),
    (0, 0, 0, 0),
    (None, None, 0, 0),  # an engine whose agent cannot count them
])
def test_a_pods_request_errors_are_judged_from_its_fresh_report(
        requests: int | None, errors: int | None, peer_caused: int, judged: int) -> None:
    """Guards against request errors read from a report that does not count them, judged
    against another limit than the deployment's maxFailureRatio, or blamed on a new pod
    whose peer went away (as its transfer health, which leaves those out)."""
    body = {"metadata": {"name": "x-decode-1", "uid": "u-1", "namespace": "default",
                         "labels": {"pd.serving.dev/role": "decode"}}}
    agent = make_agent("x-decode-1", report_time=T0, pod_uid="u-1", window=(20, peer_caused),
                       window_reasons={"PeerUnreachable": peer_caused} if peer_caused else None)
    if requests is not None:
        agent["status"]["window"].update(requests=requests, requestErrors=errors)
    fleet = observe_fleet([body], [agent], T0 + timedelta(seconds=1),
                          health=TransferHealthPolicy(max_failure_ratio=0.05))
    (pod,) = observe_instances(fleet, max_failure_ratio=0.05)
    window = agent["status"]["window"]["seconds"]
    assert pod.request_errors == (
        f"{judged} of the {requests} requests its engine ended in the last {window} s "
        "ended with a server error no peer caused (limit 5%)" if judged else "")


def test_a_pod_deleted_by_hand_comes_back_under_its_name_once_the_old_one_is_gone() -> None:
    fleet = Fleet.steady(RolloutSpec(), prefill=1, decode=3)
    fleet.drain_passes = 3
    fleet.pods["x-decode-da-1"].deleting_for = 0  # kubectl delete pod
    names_seen: list[list[str]] = []
    for _ in range(8):
        fleet.step()
        names_seen.append(sorted(p.name for p in fleet.pods.values() if p.role is Role.DECODE))
    # held in the status while the old pod drains, never a second pod of that name
    assert fleet.created == ["x-decode-da-1"]
    assert fleet.events == ["ReplacingInstance"]
    assert all(len(names) == len(set(names)) for names in names_seen)
    assert names_seen[-1] == ["x-decode-da-0", "x-decode-da-1", "x-decode-da-2"]
    assert fleet.status.phase is EngineRolloutPhase.IDLE
    decode = next(r for r in fleet.status.roles if r.role == "decode")
    assert decode.replacing == []


def test_the_replaced_name_is_kept_in_the_status_while_the_old_pod_drains() -> None:
    fleet = Fleet.steady(RolloutSpec(), prefill=1, decode=2)
    fleet.drain_passes = 5
    fleet.pods["x-decode-da-0"].deleting_for = 0
    fleet.step()
    decode = next(r for r in fleet.status.roles if r.role == "decode")
    assert decode.replacing == ["x-decode-da-0"]
    assert fleet.created == []


def test_a_failed_pod_is_deleted_and_created_again_under_its_name() -> None:
    fleet = Fleet.steady(RolloutSpec(), prefill=2, decode=1)
    fleet.pods["x-prefill-pa-0"].failed = True  # evicted: phase Failed
    for _ in range(6):
        fleet.step()
    assert fleet.events[:1] == ["InstanceFailed"] and "ReplacingInstance" in fleet.events
    assert fleet.created == ["x-prefill-pa-0"]
    assert not fleet.pods["x-prefill-pa-0"].failed


def test_a_previous_release_statefulset_fleet_moves_to_instances_with_one_start_each() -> None:
    fleet = Fleet.steady(RolloutSpec(), prefill=1, decode=2, legacy=True)
    fleet.run(EngineRolloutPhase.COMPLETE, floor={Role.PREFILL: 1, Role.DECODE: 2})
    assert sorted(fleet.created) == ["x-decode-da-0", "x-decode-da-1", "x-prefill-pa-0"]
    assert sorted(fleet.deleted_old) == ["x-decode-0@da", "x-decode-1@da", "x-prefill-0@pa"]


def test_a_rollout_replaces_the_cheapest_old_instance_first() -> None:
    fleet = Fleet.steady(RolloutSpec(), prefill=1, decode=3)
    fleet.pods["x-decode-da-0"].requests = 7
    fleet.pods["x-decode-da-1"].requests = 2
    fleet.pods["x-decode-da-2"].requests = 4
    fleet.change(Role.DECODE, "b")
    fleet.run(EngineRolloutPhase.COMPLETE, floor={Role.DECODE: 3})
    assert fleet.deleted_old == ["x-decode-da-1@da", "x-decode-da-2@da", "x-decode-da-0@da"]
    assert fleet.created == ["x-decode-db-0", "x-decode-db-1", "x-decode-db-2"]


def test_a_rollback_keeps_the_good_instances_still_running_and_starts_only_what_is_missing(
) -> None:
    fleet = Fleet.steady(RolloutSpec(max_restarts=2), prefill=1, decode=2)
    fleet.change(Role.DECODE, "b")
    # the first new decode serves and replaces an old one; then the revision crashes
    for _ in range(40):
        fleet.step()
        if any(d.endswith("@da") for d in fleet.deleted_old):
            break
    fleet.crash = {"db"}
    for pod in fleet.pods.values():
        if pod.revision == "db" and pod.age < 3:
            pod.restarts = 2
    fleet.run(EngineRolloutPhase.ROLLED_BACK, floor={Role.DECODE: 1})
    good = [d for d in fleet.deleted_old if d.endswith("@da")]
    assert len(good) == 1  # only the one the rollout had replaced before the failure
    assert fleet.revisions(Role.DECODE) == ["da", "da"]
    # one good engine started again in place of the one replaced, none for the other
    assert [c for c in fleet.created if "-da-" in c] == [good[0].split("@")[0]]
