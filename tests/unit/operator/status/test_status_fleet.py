"""The fleet observation, as data: one pass over pods and TransferAgents that every consumer
(status, gates, rollout) reads. Small real objects, a fixed clock; no cluster needed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pd_operator.api import Role
from pd_operator.api.transfer_spec import TransferHealthPolicy
from pd_operator.staging_rollout.planner import observe_pod
from pd_operator.status import ReportState, observe_fleet
from pd_testbed.kube_factories import make_agent, make_pod

NOW = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
FRESH = NOW - timedelta(seconds=5)
HEALTH = TransferHealthPolicy()


def test_one_incarnation_rule_for_status_and_rollout() -> None:
    """A report counts only when the UID that wrote it (podUID, else the agent's Pod owner
    reference) is the pod's; one written by nobody in particular counts for no one. Guards
    against the status and the rollout judging the same pod by different reports."""
    pods = [make_pod("d-0", role="decode"), make_pod("d-1", role="decode"),
            make_pod("d-2", role="decode"), make_pod("d-3", role="decode")]
    own = make_agent("d-0", report_time=FRESH, window=(10, 0))
    predecessor = make_agent("d-1", report_time=FRESH, pod_uid="old", window=(10, 0))
    by_owner = make_agent("d-2", report_time=FRESH, window=(10, 0))
    by_owner["status"]["podUID"] = ""  # the factory's owner reference names uid-d-2
    anonymous = make_agent("d-3", report_time=FRESH, window=(10, 0))
    anonymous["status"]["podUID"] = ""
    anonymous["metadata"]["ownerReferences"] = []
    fleet = observe_fleet(pods, [own, predecessor, by_owner, anonymous], NOW, health=HEALTH)
    states = {p.name: p.verdict.state for p in fleet.pods}
    assert states == {"d-0": ReportState.HEALTHY, "d-1": ReportState.MISSING,
                      "d-2": ReportState.HEALTHY, "d-3": ReportState.MISSING}
    reported = {p.name: observe_pod(p).reported is not None for p in fleet.pods}
    assert reported == {"d-0": True, "d-1": False, "d-2": True, "d-3": False}


def test_engine_pods_only_sorted_with_revision_readiness_and_gate() -> None:
    pods = [make_pod("p-1", role="prefill", template_hash="old", ready=True),
            make_pod("p-0", role="prefill", ready=True, gated=True),
            make_pod("d-0", role="decode", deleting=True, ready=True),
            {"metadata": {"name": "router-0", "uid": "r", "labels": {}}}]
    stray = make_agent("gone-0", report_time=FRESH)
    fleet = observe_fleet(pods, [stray], NOW, health=HEALTH,
                          revisions={Role.PREFILL: "rev1", Role.DECODE: "rev1"})
    assert [(p.name, p.current_revision, p.ready, p.gated, p.deleting) for p in fleet.pods] == [
        ("d-0", True, False, False, True),
        ("p-0", True, True, True, False),
        ("p-1", False, True, False, False),
    ]
    assert [p.name for p in fleet.of_role(Role.PREFILL)] == ["p-0", "p-1"]
    assert set(fleet.agents) == {"gone-0"}  # listed, but it belongs to no pod
    assert all(p.verdict.state is ReportState.MISSING for p in fleet.pods)


def test_an_unparsable_part_is_invalid_and_the_rest_is_kept() -> None:
    agent = make_agent("d-0", report_time=FRESH)
    agent["status"]["window"]["transfers"] = -3
    (pod,) = observe_fleet([make_pod("d-0", role="decode")], [agent], NOW, health=HEALTH).pods
    assert pod.verdict.state is ReportState.INVALID and pod.report is None
    assert pod.agent is not None and pod.agent.spec is not None and pod.agent.status is None
    assert "status.window.transfers" in pod.verdict.detail


def test_next_stale_in_counts_fresh_reports_only() -> None:
    pods = [make_pod("d-0", role="decode"), make_pod("d-1", role="decode")]
    agents = [make_agent("d-0", report_time=NOW - timedelta(seconds=20)),
              make_agent("d-1", report_time=NOW - timedelta(seconds=90))]
    fleet = observe_fleet(pods, agents, NOW, health=HEALTH)
    assert fleet.next_stale_in() == 40.0
    assert observe_fleet(pods, [], NOW, health=HEALTH).next_stale_in() is None


def test_a_pod_is_not_failing_for_peers_that_went_away() -> None:
    """The pod's verdict (so its readiness gate) counts only its own failures; failures
    whose cause is a peer going away are named in the detail, not held against it."""
    pods = [make_pod("p-0", role="prefill"), make_pod("d-0", role="decode")]
    agents = [make_agent("p-0", role="prefill", report_time=FRESH, window=(20, 6),
                         window_reasons={"PeerUnreachable": 4, "LeaseExpired": 2}),
              make_agent("d-0", report_time=FRESH, window=(20, 6), healthy=False,
                         window_reasons={"PeerUnreachable": 4, "TransferTimeout": 2})]
    verdicts = {p.name: p.verdict for p in observe_fleet(pods, agents, NOW,
                                                          health=HEALTH).pods}
    assert verdicts["p-0"].state is ReportState.HEALTHY
    assert verdicts["p-0"].detail == (
        "6 of 20 transfers failed in the last 60 s (6 of them because a peer went away); "
        "the agent reports healthy.")
    assert verdicts["d-0"].state is ReportState.FAILING
    assert verdicts["d-0"].detail.startswith(
        "6 of 20 transfers failed in the last 60 s (4 of them because a peer went away); "
        "its own failures: 10%, limit 5%, mostly PeerUnreachable")


def test_every_peer_caused_reason_is_one_an_agent_reports() -> None:
    """The shared list names reasons the transfer module or an engine-native mapping really
    reports (a misspelt one would never match)."""
    from pd_contract.health import PEER_CAUSED_FAILURES  # noqa: PLC0415
    from pd_transfer.native.versions import MAPPINGS  # noqa: PLC0415
    from pd_transfer.protocol.lifecycle import FailureReason  # noqa: PLC0415

    native = {spec.reason for versions in MAPPINGS.values() for mapping in versions.values()
              for spec in mapping.metrics if spec.reason}
    assert {r.value for r in FailureReason} | native >= PEER_CAUSED_FAILURES
