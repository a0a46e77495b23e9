"""The rollout's reconcile half, as data: the planner's step (pairing pods with
TransferAgents, the stamps it reads, when it stamps, when it asks to look again), the apply
body it builds, and `RolloutExecutor.execute` against a recording client (the executor's
only job: the API calls). No cluster needed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from pd_contract.transferagent import AgentStaging
from pd_operator.api.status import RolloutMode, RolloutPhase, StagingRolloutStatus
from pd_operator.api.transfer_spec import StagingRollout, TransferHealthPolicy
from pd_operator.kube import KubeClient
from pd_operator.staging_rollout.executor import RolloutExecutor
from pd_operator.staging_rollout.planner import (
    ANNOTATION_APPLIED_AT,
    ANNOTATION_WRITTEN_AT,
    MAX_RECHECK_S,
    RolloutStep,
    SpecWrite,
    StagingDecision,
    StagingPod,
    applied_stamps,
    parse_stamp,
    plan_step,
    recheck_seconds,
    staging_apply,
    staging_pods,
)
from pd_operator.status import FleetObservation, observe_fleet
from pd_testbed.factories import make_spec
from pd_testbed.kube_factories import make_agent

T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
OLD = AgentStaging(decode_pool_mib=4096, prefill_buffer_mib=4096)
BIG = AgentStaging(decode_pool_mib=6144, prefill_buffer_mib=4096)
POLICY = StagingRollout(max_unavailable=1, analysis_seconds=10)

Obj = dict[str, Any]


def pod(name: str, role: str) -> Obj:
    return {"metadata": {"name": name, "uid": f"uid-{name}", "namespace": "ns",
                         "labels": {"pd.serving.dev/role": role}}}


def agent(name: str, role: str, *, spec: AgentStaging = OLD, reported: AgentStaging = OLD,
          since: datetime | None = None, annotations: dict[str, str] | None = None,
          uid: str | None = None) -> Obj:
    body = make_agent(name, role=role, namespace="ns", pod_uid=uid or f"uid-{name}",
                      report_time=T0, staging_mib=(reported.decode_pool_mib,
                                                   reported.prefill_buffer_mib),
                      window=(50, 0))
    body["spec"]["staging"] = spec.to_wire()
    body["metadata"]["uid"] = f"agent-{name}"
    if since is not None:
        body["status"]["stagingSince"] = since.strftime("%Y-%m-%dT%H:%M:%SZ")
    if annotations:
        body["metadata"]["annotations"] = annotations
    return body


FLEET = [pod("p-0", "prefill"), pod("d-0", "decode")]


def observe(pods: list[Obj], agents: list[Obj]) -> FleetObservation:
    return observe_fleet(pods, agents, T0, health=TransferHealthPolicy())


def observed_pods(pods: list[Obj], agents: list[Obj]) -> list[StagingPod]:
    return staging_pods(observe(pods, agents))


def test_stamps_parse_and_bad_ones_count_as_absent() -> None:
    good = agent("d-0", "decode", annotations={ANNOTATION_WRITTEN_AT: "2024-05-01T12:00:05Z"})
    assert parse_stamp(good, ANNOTATION_WRITTEN_AT) == T0 + timedelta(seconds=5)
    assert parse_stamp(good, ANNOTATION_APPLIED_AT) is None
    bad = agent("d-0", "decode", annotations={ANNOTATION_WRITTEN_AT: "yesterday"})
    assert parse_stamp(bad, ANNOTATION_WRITTEN_AT) is None


def test_rollout_pods_pair_pods_with_their_agents_and_skips_the_rest() -> None:
    written = T0 - timedelta(seconds=30)
    agents = [
        agent("d-0", "decode", spec=BIG, since=T0 - timedelta(seconds=50),
              annotations={ANNOTATION_WRITTEN_AT: written.strftime("%Y-%m-%dT%H:%M:%SZ")}),
        agent("stray", "decode"),  # no such pod
    ]
    pods = [*FLEET, {"metadata": {"name": "router", "uid": "r", "labels": {}}}]
    observed = observed_pods(pods, agents)
    assert [p.name for p in observed] == ["d-0"]  # p-0 has no TransferAgent yet
    d0 = observed[0]
    assert (d0.spec, d0.reported) == (BIG, OLD)
    assert d0.written_at == written
    assert d0.applied_at == T0 - timedelta(seconds=50)


def test_applied_at_falls_back_to_the_stamp_and_ignores_a_predecessors_report() -> None:
    stamped = {ANNOTATION_APPLIED_AT: "2024-05-01T11:59:00Z"}
    mine = observed_pods(FLEET[1:], [agent("d-0", "decode", annotations=stamped)])[0]
    assert mine.applied_at == T0 - timedelta(minutes=1)
    theirs = observed_pods(FLEET[1:], [agent("d-0", "decode", uid="old-uid",
                                             since=T0 - timedelta(hours=1))])[0]
    assert theirs.reported is None and theirs.applied_at is None


def test_staging_apply_owns_only_the_size_and_the_stamps() -> None:
    body = staging_apply(agent("d-0", "decode"), BIG, written_at=T0, applied_at=None)
    assert body == {
        "apiVersion": "pd.serving.dev/v1alpha1",
        "kind": "TransferAgent",
        "metadata": {"name": "d-0", "namespace": "ns", "uid": "agent-d-0",
                     "annotations": {ANNOTATION_WRITTEN_AT: "2024-05-01T12:00:00Z"}},
        "spec": {"staging": {"decodePoolMiB": 6144, "prefillBufferMiB": 4096}},
    }
    bare = staging_apply(agent("d-0", "decode"), OLD, written_at=None, applied_at=None)
    assert "annotations" not in bare["metadata"]


def decision(phase: RolloutPhase, *, writes: tuple[SpecWrite, ...] = (),
             applied_now: tuple[str, ...] = (), to: int | None = 6144,
             mode: RolloutMode | None = RolloutMode.FORWARD) -> StagingDecision:
    status = StagingRolloutStatus(phase=phase, from_decode_pool_mib=4096,
                                  to_decode_pool_mib=to, from_prefill_buffer_mib=4096,
                                  to_prefill_buffer_mib=4096 if to else None,
                                  mode=mode if to else None)
    return StagingDecision(status, writes, (), applied_now)


def test_applied_stamps_only_while_progressing_and_only_where_the_agent_is_silent() -> None:
    agents = {
        "p-0": agent("p-0", "prefill"),
        "d-0": agent("d-0", "decode", since=T0),
        "d-1": agent("d-1", "decode", annotations={ANNOTATION_APPLIED_AT:
                                                   "2024-05-01T12:00:00Z"}),
        "d-2": agent("d-2", "decode"),
    }
    every = ("p-0", "d-0", "d-1", "d-2")
    moving = decision(RolloutPhase.PROGRESSING, applied_now=every,
                      writes=(SpecWrite("d-2", BIG),))
    assert applied_stamps(moving, agents) == ("p-0",)
    for phase in (RolloutPhase.IDLE, RolloutPhase.COMPLETE, RolloutPhase.ROLLED_BACK):
        assert applied_stamps(decision(phase, applied_now=every), agents) == ()


def step(phase: RolloutPhase, pods: list[Any], to: int | None = 6144,
         mode: RolloutMode = RolloutMode.FORWARD) -> RolloutStep:
    return RolloutStep(decision(phase, to=to, mode=mode), tuple(pods), {}, (), T0)


def test_recheck_comes_back_when_the_earliest_analysis_ends_at_most_5s_away() -> None:
    fleet = observed_pods(FLEET, [
        agent("p-0", "prefill", since=T0 - timedelta(hours=1)),
        agent("d-0", "decode", spec=BIG, reported=BIG, since=T0 - timedelta(seconds=8)),
    ])
    assert recheck_seconds(step(RolloutPhase.PROGRESSING, fleet), POLICY) == 3.0
    long = StagingRollout(max_unavailable=1, analysis_seconds=60)
    assert recheck_seconds(step(RolloutPhase.PROGRESSING, fleet), long) == MAX_RECHECK_S
    rolling_back = step(RolloutPhase.PAUSED, fleet, mode=RolloutMode.ROLLBACK)
    assert recheck_seconds(rolling_back, POLICY) == 3.0
    held = step(RolloutPhase.PAUSED, fleet, mode=RolloutMode.HOLD)
    assert recheck_seconds(held, POLICY) is None
    refused = step(RolloutPhase.PAUSED, fleet, to=None, mode=RolloutMode.ROLLBACK)
    assert recheck_seconds(refused, POLICY) is None
    for phase in (RolloutPhase.IDLE, RolloutPhase.COMPLETE, RolloutPhase.ROLLED_BACK):
        assert recheck_seconds(step(phase, fleet), POLICY) is None


def spec_with(size: AgentStaging) -> Any:
    return make_spec(transfer={"staging": {
        "mode": "Always", "decodePoolMiB": size.decode_pool_mib,
        "prefillBufferMiB": size.prefill_buffer_mib,
        "rollout": {"maxUnavailable": 1, "analysisSeconds": 10}}})


def test_plan_step_in_steady_state_writes_nothing() -> None:
    agents = [agent("p-0", "prefill", since=T0 - timedelta(hours=1)),
              agent("d-0", "decode", since=T0 - timedelta(hours=1))]
    planned = plan_step(spec_with(OLD), StagingRolloutStatus(), observe(FLEET, agents))
    assert planned is not None
    assert planned.decision.status.phase is RolloutPhase.IDLE
    assert planned.decision.writes == () and planned.stamp_applied == ()
    again = plan_step(spec_with(OLD), planned.decision.status, observe(FLEET, agents))
    assert again is not None and again.decision == planned.decision


def test_plan_step_starts_with_the_decode_ring_when_the_pool_grows() -> None:
    agents = [agent("p-0", "prefill", since=T0 - timedelta(hours=1)),
              agent("d-0", "decode", since=T0 - timedelta(hours=1))]
    previous = StagingRolloutStatus(phase=RolloutPhase.IDLE, to_decode_pool_mib=4096,
                                    to_prefill_buffer_mib=4096)
    planned = plan_step(spec_with(BIG), previous, observe(FLEET, agents))
    assert planned is not None
    assert planned.decision.status.phase is RolloutPhase.PROGRESSING
    assert planned.decision.writes == (SpecWrite("d-0", BIG),)
    assert set(planned.agents) == {"p-0", "d-0"}


def test_plan_step_is_none_without_staging() -> None:
    spec = make_spec(transfer={"staging": {"mode": "Never"}})
    assert plan_step(spec, StagingRolloutStatus(), observe(FLEET, [])) is None


class Recorder(KubeClient):
    def __init__(self) -> None:
        self.applied: list[Obj] = []

    def apply(self, manifest: Any) -> Obj:
        self.applied.append(dict(manifest))
        return dict(manifest)


def test_execute_writes_sizes_then_stamps_and_skips_missing_agents() -> None:
    written_at = {ANNOTATION_WRITTEN_AT: "2024-05-01T11:00:00Z"}
    agents = {"p-0": agent("p-0", "prefill", annotations=written_at),
              "d-0": agent("d-0", "decode")}
    pods = tuple(observed_pods(FLEET, list(agents.values())))
    planned = RolloutStep(
        decision(RolloutPhase.PROGRESSING,
                 writes=(SpecWrite("d-0", BIG), SpecWrite("gone", BIG))),
        pods, agents, ("p-0",), T0)
    kube = Recorder()
    assert RolloutExecutor(kube).execute(planned) == 2
    first, second = kube.applied
    assert first["metadata"]["name"] == "d-0"
    assert first["spec"]["staging"]["decodePoolMiB"] == 6144
    assert first["metadata"]["annotations"] == {ANNOTATION_WRITTEN_AT: "2024-05-01T12:00:00Z"}
    assert second["metadata"]["name"] == "p-0"
    assert second["spec"]["staging"]["decodePoolMiB"] == 4096
    assert second["metadata"]["annotations"] == {**written_at,
                                                 ANNOTATION_APPLIED_AT: "2024-05-01T12:00:00Z"}
