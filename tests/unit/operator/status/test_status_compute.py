"""`compute_status` as data: small real pods, a fixed clock, whole statuses compared.
No cluster and no GPU needed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pd_operator.api import ConditionStatus, PDDeploymentStatus, Phase, Role
from pd_operator.api.status import RoleStatus, StagingRolloutStatus, TransferStatus
from pd_operator.api.transfer_spec import TransferHealthPolicy
from pd_operator.status import (
    NOT_READY_DEADLINE,
    Observed,
    PDDSnapshot,
    RoleObservation,
    compute_status,
    find_condition,
    observe_fleet,
)
from pd_testbed.factories import make_pdd
from pd_testbed.kube_factories import make_pod, make_pods, make_router_deployment

NOW = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
SEL_P = "pd.serving.dev/deployment=llama,pd.serving.dev/role=prefill"
SEL_D = "pd.serving.dev/deployment=llama,pd.serving.dev/role=decode"


def observed(prefill_pods=(), decode_pods=(), *, desired=2, revision="rev1", **kw) -> Observed:
    fleet = observe_fleet([*prefill_pods, *decode_pods], [], NOW,
                          health=TransferHealthPolicy(),
                          revisions={Role.PREFILL: revision, Role.DECODE: revision})
    return Observed(
        prefill=RoleObservation(desired, revision, SEL_P),
        decode=RoleObservation(desired, revision, SEL_D),
        fleet=fleet,
        **kw,
    )


def status_of(pdd_status: PDDeploymentStatus, type_: str) -> tuple[str, str]:
    c = find_condition(pdd_status.conditions, type_)
    assert c is not None, f"{type_} missing"
    return c.status.value, c.reason


def test_all_ready_pods_of_current_revision_make_ready() -> None:
    pdd = make_pdd()  # generation 0 from the factory
    got = compute_status(pdd, observed(make_pods("prefill", 2, ready=2),
                                       make_pods("decode", 2, ready=2)), NOW)
    # staging: prefill TP1 == decode TP1 in the base spec, so Auto does not stage.
    expected_role = RoleStatus(replicas=2, ready_replicas=2, updated_replicas=2,
                               revision="rev1", selector=SEL_P, summary="2/2")
    assert got.prefill == expected_role
    assert got.decode == expected_role.model_copy(update={"selector": SEL_D})
    # No TransferAgent reports at all: nothing to aggregate yet.
    assert got.transfer == TransferStatus(summary="NoReports")
    assert got.staging_rollout == StagingRolloutStatus(summary="Unused")
    assert got.phase is Phase.READY
    assert [c.type for c in got.conditions] == [
        "SpecValid", "Ready", "Progressing", "Degraded", "TransferHealthy",
        "TransportVerified", "StagingPoolReady"]
    assert status_of(got, "Ready") == ("True", "AllReplicasReady")
    assert status_of(got, "Progressing") == ("False", "ReconcileComplete")
    assert status_of(got, "Degraded") == ("False", "AsExpected")
    for t in ("TransferHealthy", "TransportVerified"):
        assert status_of(got, t) == ("Unknown", "NoReports")
    assert status_of(got, "StagingPoolReady") == ("True", "NotInUse")
    assert all(c.last_transition_time == NOW for c in got.conditions)


def test_old_revision_pods_never_count_as_ready_or_updated() -> None:
    """Guards against docs/failure-modes.md #20: Ready pods of the previous revision reported as
    ready.
    prefill: 2 old Ready pods + 1 new not-ready pod -> replicas 3, updated 1, ready 0."""
    prefill = [*make_pods("prefill", 2, template_hash="old", ready=2),
               make_pod("llama-prefill-2", template_hash="new")]
    decode = make_pods("decode", 2, template_hash="new", ready=2)
    got = compute_status(make_pdd(), observed(prefill, decode, revision="new"), NOW)
    assert (got.prefill.replicas, got.prefill.updated_replicas, got.prefill.ready_replicas) == \
        (3, 1, 0)
    assert got.prefill.summary == "0/2"
    assert status_of(got, "Ready") == ("False", "ReplicasNotReady")
    assert status_of(got, "Progressing") == ("True", "RollingUpdate")
    assert got.phase is Phase.PROGRESSING


def test_terminating_pod_is_not_ready() -> None:
    pods = [make_pod("llama-prefill-0", ready=True, deleting=True),
            make_pod("llama-prefill-1", ready=True)]
    got = compute_status(make_pdd(), observed(pods, make_pods("decode", 2, ready=2)), NOW)
    assert got.prefill.ready_replicas == 1


def test_created_children_show_as_progressing_creating() -> None:
    got = compute_status(make_pdd(), observed(created=("StatefulSet/llama-prefill",)), NOW)
    assert status_of(got, "Progressing") == ("True", "Creating")
    assert "StatefulSet/llama-prefill" in find_condition(got.conditions, "Progressing").message
    assert got.phase is Phase.PROGRESSING


def test_router_must_be_available_when_enabled() -> None:
    pods = make_pods("prefill", 2, ready=2), make_pods("decode", 2, ready=2)
    down = compute_status(make_pdd(), observed(*pods, router_enabled=True, router_replicas=2,
                                               router=make_router_deployment(1)), NOW)
    assert status_of(down, "Ready") == ("False", "RouterUnavailable")
    up = compute_status(make_pdd(), observed(*pods, router_enabled=True, router_replicas=2,
                                             router=make_router_deployment(2)), NOW)
    assert status_of(up, "Ready") == ("True", "AllReplicasReady")


def test_failure_and_not_ready_deadline_make_degraded() -> None:
    failed = compute_status(make_pdd(), observed(failure="PATCH ... refused: bad port"), NOW)
    assert status_of(failed, "Degraded") == ("True", "ReconcileFailed")
    assert find_condition(failed.conditions, "Degraded").message == "PATCH ... refused: bad port"
    assert failed.phase is Phase.DEGRADED

    # Not ready since NOW; just before the deadline nothing is degraded, just after it is.
    pdd = make_pdd()
    first = compute_status(pdd, observed(), NOW)
    later = pdd.model_copy(update={"status": first})
    before = compute_status(later, observed(), NOW + NOT_READY_DEADLINE)
    assert status_of(before, "Degraded") == ("False", "AsExpected")
    after = compute_status(later, observed(), NOW + NOT_READY_DEADLINE + timedelta(seconds=1))
    assert status_of(after, "Degraded") == ("True", "NotReadyTooLong")
    ready = find_condition(after.conditions, "Ready")
    assert ready.last_transition_time == NOW  # the Ready condition did not flip
    message = find_condition(after.conditions, "Degraded").message
    assert message.startswith(f"Not Ready since {NOW:%Y-%m-%dT%H:%M:%SZ}, more than 15 minutes")
    # Steady while nothing changes: an hour on, the same status (no write per resync).
    hour = compute_status(later.model_copy(update={"status": after}), observed(),
                          NOW + timedelta(hours=1))
    assert hour.to_wire() == after.to_wire()


def test_invalid_spec_keeps_previous_counts_and_conditions() -> None:
    """An invalid new generation flips SpecValid only; what was observed before stays, with
    its own observedGeneration, and the phase reads Invalid."""
    pdd = make_pdd()
    valid = compute_status(pdd, observed(make_pods("prefill", 2, ready=2),
                                         make_pods("decode", 2, ready=2)), NOW)
    later = NOW + timedelta(minutes=1)
    got = compute_status(PDDSnapshot(generation=2, previous=valid, spec=None), None, later,
                         "spec.prefill.parallelism: bad")
    assert got.observed_generation == 2
    assert got.phase is Phase.INVALID
    spec_valid = find_condition(got.conditions, "SpecValid")
    assert (spec_valid.status, spec_valid.reason, spec_valid.message) == \
        (ConditionStatus.FALSE, "InvalidSpec", "spec.prefill.parallelism: bad")
    assert spec_valid.last_transition_time == later
    assert got.prefill == valid.prefill
    assert find_condition(got.conditions, "Ready") == find_condition(valid.conditions, "Ready")


def test_invalid_spec_on_first_visit_sets_every_condition() -> None:
    got = compute_status(PDDSnapshot(1, PDDeploymentStatus(), None), None, NOW, "spec.x: bad")
    assert len(got.conditions) == 7
    assert status_of(got, "Ready") == ("Unknown", "SpecInvalid")


def test_recomputing_an_unchanged_world_gives_an_equal_status() -> None:
    """The steady state must compare equal, or the operator writes status forever."""
    pdd = make_pdd()
    obs = observed(make_pods("prefill", 2, ready=1), make_pods("decode", 2))
    first = compute_status(pdd, obs, NOW)
    again = compute_status(pdd.model_copy(update={"status": first}), obs,
                           NOW + timedelta(seconds=30))
    assert again.to_wire() == first.to_wire()


def _workload(kind: str, name: str, *conditions: dict[str, str]) -> dict[str, object]:
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name},
            "status": {"conditions": list(conditions)}}


def test_child_workload_failures_make_degraded_with_the_childs_reason() -> None:
    """The router Deployment's ReplicaFailure and progress deadline surface as Degraded=True
    with the child's reason and message (docs/failure-modes.md #29: workloads whose pods
    could not be created left the PDDeployment "Progressing: Creating" forever without a
    word). Healthy conditions (ReplicaFailure=False, Progressing=True) change nothing."""
    replicas = _workload("Deployment", "llama-router", {
        "type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
        "message": 'pods "llama-router-5d4f-x" is forbidden: exceeded quota: no-pods'})
    got = compute_status(make_pdd(), observed(workloads=(replicas,)), NOW)
    degraded = find_condition(got.conditions, "Degraded")
    assert (degraded.status.value, degraded.reason, degraded.message) == (
        "True", "FailedCreate",
        'Deployment llama-router: FailedCreate: pods "llama-router-5d4f-x" is forbidden: '
        "exceeded quota: no-pods")
    assert got.phase is Phase.DEGRADED

    deploy = _workload("Deployment", "llama-router", {
        "type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "llama-router-5d4f" has timed out progressing.'})
    got = compute_status(make_pdd(), observed(workloads=(deploy,)), NOW)
    assert status_of(got, "Degraded") == ("True", "ProgressDeadlineExceeded")

    # Two different child reasons: one generic reason, both messages.
    got = compute_status(make_pdd(), observed(workloads=(replicas, deploy)), NOW)
    degraded = find_condition(got.conditions, "Degraded")
    assert degraded.reason == "ChildFailed"
    assert degraded.message.startswith("Deployment llama-router: FailedCreate: ")
    assert 'Deployment llama-router: ProgressDeadlineExceeded: ReplicaSet "llama-router-5d4f"' \
        in degraded.message

    fine = (_workload("Deployment", "llama-router",
                      {"type": "ReplicaFailure", "status": "False", "reason": "AsExpected"},
                      {"type": "Progressing", "status": "True",
                       "reason": "NewReplicaSetAvailable"}),)
    got = compute_status(make_pdd(), observed(workloads=fine), NOW)
    assert status_of(got, "Degraded") == ("False", "AsExpected")


def test_a_role_scaled_to_zero_is_not_ready_says_so_and_never_degrades() -> None:
    """Scale to 0 means what the docs say: nothing can be served, the status says which
    role and how to serve again, and it is a choice, not a failure: no NotReadyTooLong."""
    decode = make_pods("decode", 2, ready=2)
    seen = Observed(prefill=RoleObservation(0, "rev1", SEL_P),
                    decode=RoleObservation(2, "rev1", SEL_D),
                    fleet=observe_fleet(decode, [], NOW, health=TransferHealthPolicy(),
                                        revisions={Role.PREFILL: "rev1", Role.DECODE: "rev1"}))
    pdd = make_pdd(prefill={"replicas": 0})
    got = compute_status(pdd, seen, NOW)
    ready = find_condition(got.conditions, "Ready")
    assert ready is not None and (ready.status.value, ready.reason) == ("False", "ScaledToZero")
    assert ready.message == (
        "prefill scaled to 0 replicas: no request can be served (the router holds each for "
        "its endpoint wait, then answers 503). Scale the role's PDRole (`kubectl scale pdrole "
        "<name>-<role>`) up to serve again.")
    assert got.phase is Phase.SCALED_TO_ZERO
    later = compute_status(pdd.model_copy(update={"status": got}), seen,
                           NOW + NOT_READY_DEADLINE + timedelta(hours=1))
    assert status_of(later, "Degraded") == ("False", "AsExpected")
    assert later.phase is Phase.SCALED_TO_ZERO
