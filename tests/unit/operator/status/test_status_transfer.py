"""Transfer health aggregated from TransferAgent reports, as data: small real pods and
agents, a fixed clock, whole `TransferStatus` values and conditions compared.
No cluster, no NIXL and no GPU needed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from pd_operator.api import ConditionStatus
from pd_operator.api.conditions import Condition
from pd_operator.api.spec import PDDeploymentSpec
from pd_operator.api.status import (
    ObservedTransport,
    StagingWatermark,
    StalePeer,
    TransferStatus,
    TransferTotals,
)
from pd_operator.reconcile import transfer_gate_changes
from pd_operator.status import (
    FleetObservation,
    Observed,
    PodReport,
    ReportState,
    RoleObservation,
    compute_status,
    compute_transfer_status,
    find_condition,
    observe_fleet,
)
from pd_operator.status.transfer import TransportClass, classify_transport
from pd_testbed.factories import make_pdd, make_spec
from pd_testbed.kube_factories import make_agent, make_pod

NOW = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
FRESH = NOW - timedelta(seconds=5)
MIB = 1024 * 1024
# Prefill TP4 -> decode TP2 stages (Auto, TPs differ). One chunk on a decode rank:
# 8192 tokens x 4 heads (8 KV heads / TP2) x 128 dim x 2 bytes (bf16) x 2 (K, V) x 80 layers
# = 1_342_177_280 bytes = 1280 MiB, the smallest valid decode pool.
STAGED = {"prefill": {"parallelism": {"tensor": 4}}, "decode": {"parallelism": {"tensor": 2}}}
RING = {"capacityBytes": 8192 * MIB, "usedBytes": 1024 * MIB, "highWaterBytes": 2048 * MIB,
        "largestFreeExtentBytes": 7168 * MIB}


def spec(**overrides: Any) -> PDDeploymentSpec:
    return make_spec(**{**STAGED, **overrides})


def fleet() -> list[dict[str, Any]]:
    return [make_pod("llama-prefill-0", role="prefill", ready=True),
            make_pod("llama-decode-0", role="decode", ready=True),
            make_pod("llama-decode-1", role="decode", ready=True)]


def observe(s: PDDeploymentSpec, pods: list[dict[str, Any]], agents: list[dict[str, Any]],
            now: datetime = NOW) -> FleetObservation:
    return observe_fleet(pods, agents, now, health=s.transfer.health)


def transfer_status(s: PDDeploymentSpec, pods: list[dict[str, Any]],
                    agents: list[dict[str, Any]], now: datetime = NOW,
                    ) -> tuple[TransferStatus, list[Condition]]:
    return compute_transfer_status(s, observe(s, pods, agents, now))


def pod_reports(s: PDDeploymentSpec, pods: list[dict[str, Any]], agents: list[dict[str, Any]],
                now: datetime = NOW) -> tuple[PodReport, ...]:
    return observe(s, pods, agents, now).reports


def healthy_agents(**decode1: Any) -> list[dict[str, Any]]:
    return [
        make_agent("llama-prefill-0", role="prefill", report_time=FRESH, window=(100, 0),
                   totals=(10 * MIB, 1000, 2), failures_by_reason={"GrantTimeout": 2},
                   transports=[("llama-decode-0", "rc_mlx5"), ("llama-decode-1", "rc")],
                   pending_kv=(2, 3 * MIB, 1.5)),
        make_agent("llama-decode-0", report_time=FRESH, window=(60, 0), ring=RING,
                   totals=(20 * MIB, 600, 0), transports=[("llama-prefill-0", "rc")],
                   live_requests=3, pending_kv=(3, 5 * MIB, 4.0)),
        make_agent("llama-decode-1", **{
            "report_time": FRESH, "window": (40, 0), "ring": RING, "totals": (5 * MIB, 400, 0),
            "transports": [("llama-prefill-0", "cuda_ipc")], **decode1}),
    ]


def cond(conditions: list[Condition], type_: str) -> Condition:
    found = find_condition(conditions, type_)
    assert found is not None, f"{type_} missing"
    return found


def test_healthy_fleet_gives_the_whole_transfer_status_and_true_conditions() -> None:
    got, conditions = transfer_status(spec(), fleet(), healthy_agents(), NOW)
    watermark = {"pool_mib": 4096, "used_mib": 1024.0, "high_water_mib": 2048.0,
                 "report_time": FRESH}
    assert got == TransferStatus(
        reporting_pods=3,
        # pending KV: the prefill pod's only (decode's KV still landing is not "held")
        totals=TransferTotals(bytes=35 * MIB, transfers=2000, failures=2, live_requests=3,
                              prefill_pending_kv_bytes=3 * MIB,
                              prefill_pending_kv_oldest_seconds=1.5),
        failure_ratio=0.0,
        failures_by_reason={"GrantTimeout": 2},  # cumulative, from the prefill pod
        watermarks=[
            StagingWatermark(pod="llama-decode-0", role="decode", **watermark),
            StagingWatermark(pod="llama-decode-1", role="decode", **watermark),
            # the prefill pod's ring is empty; its pool is its prefill buffer
            StagingWatermark(pod="llama-prefill-0", role="prefill", pool_mib=2048,
                             report_time=FRESH),
        ],
        observed_transports=[
            ObservedTransport(pod="llama-decode-0", transport="rc"),
            ObservedTransport(pod="llama-decode-1", transport="cuda_ipc"),
            ObservedTransport(pod="llama-prefill-0", transport="rc"),
            ObservedTransport(pod="llama-prefill-0", transport="rc_mlx5"),
        ],
        # per-rank high water = 2048 MiB x (4096 pool / 8192 capacity) = 1024 MiB;
        # x 1.25 = 1280 MiB; one chunk is 1280 MiB (the admission minimum) -> 1 chunk.
        recommended_decode_pool_mib=1280,
        recommendation_basis=(
            "1280 MiB = one prefill chunk (1342177280 bytes per decode rank, rounded up to "
            "1280 MiB: the admission minimum); the highest per-rank decode occupancy, "
            "1024.0 MiB (llama-decode-0), × 1.25 headroom = 1280.0 MiB, fits in it."),
        summary="Healthy",
    )
    assert [(c.type, c.status, c.reason) for c in conditions] == [
        ("TransferHealthy", ConditionStatus.TRUE, "TransfersHealthy"),
        ("TransportVerified", ConditionStatus.TRUE, "RDMAVerified"),
        ("StagingPoolReady", ConditionStatus.TRUE, "PoolSizeApplied"),
    ]
    assert all(c.last_transition_time == NOW for c in conditions)
    # invariant: every pod's gate is True exactly when its report is Healthy
    reports = pod_reports(spec(), fleet(), healthy_agents(), NOW)
    assert [(r.pod, r.state) for r in reports] == [
        ("llama-decode-0", ReportState.HEALTHY), ("llama-decode-1", ReportState.HEALTHY),
        ("llama-prefill-0", ReportState.HEALTHY)]


def test_one_failing_pod_turns_transfer_healthy_false_with_its_top_reason_and_name() -> None:
    """Guards against docs/failure-modes.md #20: all pods Ready while transfers fail must not look
    healthy.
    Window: 100 + 60 + 40 transfers, 30 failures (all on decode-1) -> 30/200 = 15% > 5%."""
    agents = healthy_agents(window=(40, 30), healthy=False,
                            window_reasons={"GrantTimeout": 25, "TransferTimeout": 5},
                            recent_failures=[
                                {"pod": "llama-decode-1", "reason": "GrantTimeout",
                                 "time": "2024-05-01T11:59:50Z"},
                                {"pod": "llama-decode-1", "reason": "TransferTimeout",
                                 "time": "2024-05-01T11:59:58Z"}])
    got, conditions = transfer_status(spec(), fleet(), agents, NOW)
    healthy = cond(conditions, "TransferHealthy")
    assert (healthy.status, healthy.reason) == (ConditionStatus.FALSE, "GrantTimeout")
    assert "llama-decode-1" in healthy.message and "llama-decode-0:" not in healthy.message
    assert got.failure_ratio == 0.15 and got.summary == "Failing 15%"
    assert [(f.reason, f.time.second) for f in got.recent_failures] == [
        ("TransferTimeout", 58), ("GrantTimeout", 50)]  # newest first
    reports = {r.pod: r for r in pod_reports(spec(), fleet(), agents, NOW)}
    assert reports["llama-decode-1"].gate()[:2] == (ConditionStatus.FALSE, "TransferFailing")
    assert reports["llama-decode-0"].gate()[:2] == (ConditionStatus.TRUE, "TransferHealthy")


def test_ready_is_false_while_transfers_fail_for_gated_pods_only() -> None:
    """The status must agree with the readiness gates: Ready=True with TransferHealthy=False
    is a lie for pods whose gate the operator holds False."""
    pdd = make_pdd(**STAGED)
    pods = [make_pod("llama-prefill-0", role="prefill", ready=True),
            make_pod("llama-decode-0", role="decode", ready=True),
            make_pod("llama-decode-1", role="decode", ready=True)]
    agents = healthy_agents(window=(40, 30), healthy=False)

    def observed(gate: bool) -> Observed:
        return Observed(prefill=RoleObservation(1, "rev1", "p"),
                        decode=RoleObservation(2, "rev1", "d"),
                        fleet=observe(spec(), pods, agents), transfer_gate=gate)

    gated = compute_status(pdd, observed(True), NOW)
    assert (cond(gated.conditions, "Ready").status, cond(gated.conditions, "Ready").reason) \
        == (ConditionStatus.FALSE, "TransferUnhealthy")
    ungated = compute_status(pdd, observed(False), NOW)
    assert cond(ungated.conditions, "Ready").status is ConditionStatus.TRUE
    assert cond(ungated.conditions, "TransferHealthy").status is ConditionStatus.FALSE


def test_stale_report_makes_the_pod_unknown_never_healthy() -> None:
    """Guards against docs/failure-modes.md #22: a report that stopped arriving reads as healthy
    forever.
    staleAfterSeconds defaults to 60: a 61 s old report is stale, a 60 s old one is not."""
    agents = healthy_agents(report_time=NOW - timedelta(seconds=61))
    got, conditions = transfer_status(spec(), fleet(), agents, NOW)
    healthy = cond(conditions, "TransferHealthy")
    assert (healthy.status, healthy.reason) == (ConditionStatus.UNKNOWN, "ReportsStale")
    assert "llama-decode-1" in healthy.message
    assert got.stale_pods == ["llama-decode-1"] and got.reporting_pods == 2
    assert got.summary == "Unknown"
    reports = {r.pod: r for r in pod_reports(spec(), fleet(), agents, NOW)}
    assert reports["llama-decode-1"].gate()[:2] == (ConditionStatus.FALSE, "ReportStale")
    at_limit = healthy_agents(report_time=NOW - timedelta(seconds=60))
    _, conditions = transfer_status(spec(), fleet(), at_limit, NOW)
    assert cond(conditions, "TransferHealthy").status is ConditionStatus.TRUE
    # the reconcile comes back when the first fresh report turns stale: FRESH + 60 s - NOW
    assert observe(spec(), fleet(), healthy_agents()).next_stale_in() == 55.0


def test_report_of_an_old_incarnation_is_ignored() -> None:
    """A pod recreated under the same name must not inherit its predecessor's health."""
    pods = [make_pod("llama-decode-0", role="decode", uid="new-uid")]
    agents = [make_agent("llama-decode-0", report_time=FRESH, pod_uid="old-uid",
                         window=(50, 0), totals=(MIB, 50, 0))]
    got, conditions = transfer_status(spec(), pods, agents, NOW)
    assert got == TransferStatus(summary="NoReports")
    healthy = cond(conditions, "TransferHealthy")
    assert (healthy.status, healthy.reason) == (ConditionStatus.UNKNOWN, "NoReports")
    (report,) = pod_reports(spec(), pods, agents, NOW)
    assert report.state is ReportState.MISSING and "earlier incarnation" in report.detail
    # and an agent of a pod that no longer exists is not counted at all
    assert transfer_status(spec(), [], agents, NOW)[0] == TransferStatus(
        summary="NoReports")


def test_malformed_agent_is_reported_not_crashed_on() -> None:
    pods = [make_pod("llama-decode-0", role="decode")]
    agent = make_agent("llama-decode-0", report_time=FRESH)
    agent["status"]["window"]["transfers"] = -3
    _, conditions = transfer_status(spec(), pods, [agent], NOW)
    healthy = cond(conditions, "TransferHealthy")
    assert (healthy.status, healthy.reason) == (ConditionStatus.UNKNOWN, "ReportInvalid")
    assert "status.window.transfers" in healthy.message


def test_state_held_for_an_earlier_incarnation_of_a_peer_is_named() -> None:
    """docs/failure-modes.md #10: llama-prefill-0 restarted (its agents are now p-new-*);
    decode-0 still holds the old ones, decode-1 already dropped them, and prefill-0 holds a
    pod scaled away. A peer that has not reported its agents yet is not judged."""
    pods = [*fleet(), make_pod("llama-prefill-1", role="prefill", ready=True)]
    agents = [
        make_agent("llama-prefill-0", role="prefill", report_time=FRESH,
                   agents=["p-new-r0", "p-new-r1"],
                   peers={"llama-decode-1": ["d1-r0"], "llama-decode-7": ["d7-r0"]}),
        make_agent("llama-prefill-1", role="prefill", report_time=FRESH),  # no agents yet
        make_agent("llama-decode-0", report_time=FRESH, agents=["d0-r0"],
                   peers={"llama-prefill-0": ["p-old-r0", "p-old-r1"],
                          "llama-prefill-1": ["q-r0"]}),
        make_agent("llama-decode-1", report_time=FRESH, agents=["d1-r0"],
                   peers={"llama-prefill-0": ["p-new-r0", "p-new-r1"]}),
    ]
    got, _ = transfer_status(spec(), pods, agents, NOW)
    assert got.stale_peers == [
        StalePeer(pod="llama-decode-0", peer="llama-prefill-0",
                  held_agents=["p-old-r0", "p-old-r1"],
                  message="llama-decode-0 holds transfer state for an earlier incarnation of "
                          "llama-prefill-0 (agents p-old-r0, p-old-r1); llama-prefill-0 now "
                          "runs p-new-r0, p-new-r1."),
        StalePeer(pod="llama-prefill-0", peer="llama-decode-7", held_agents=["d7-r0"],
                  message="llama-prefill-0 holds transfer state for llama-decode-7, which is "
                          "no longer a pod of this deployment."),
    ]
    # Only fresh reports speak for the pod now: a stale one is history.
    old = [make_agent("llama-decode-0", report_time=NOW - timedelta(seconds=600),
                      agents=["d0-r0"], peers={"llama-prefill-0": ["p-old-r0"]}),
           *agents[:2]]
    assert transfer_status(spec(), pods, old, NOW)[0].stale_peers == [got.stale_peers[1]]


def test_tcp_with_rdma_required_is_a_silent_fallback_naming_the_pod() -> None:
    """Guards against docs/failure-modes.md #21: RDMA configured, TCP used, nobody notices."""
    agents = healthy_agents(transports=[("llama-prefill-0", "tcp"), ("x", "rc")])
    _, conditions = transfer_status(spec(), fleet(), agents, NOW)
    verified = cond(conditions, "TransportVerified")
    assert (verified.status, verified.reason) == (ConditionStatus.FALSE, "TCPFallback")
    assert "llama-decode-1 uses tcp" in verified.message
    assert "llama-decode-0" not in verified.message
    # same-host transports are fine; an unrecognised one counts as a fallback
    assert classify_transport("cuda_ipc") is TransportClass.SAME_HOST
    assert classify_transport("dc_mlx5") is TransportClass.RDMA
    assert classify_transport("sockcm") is TransportClass.FALLBACK


def test_rdma_not_required_accepts_tcp() -> None:
    agents = healthy_agents(transports=[("llama-prefill-0", "tcp")])
    _, conditions = transfer_status(
        spec(network={"rdma": {"required": False}}), fleet(), agents, NOW)
    verified = cond(conditions, "TransportVerified")
    assert (verified.status, verified.reason) == (ConditionStatus.TRUE, "NotRequired")


def test_no_transport_seen_is_unknown() -> None:
    agents = [make_agent("llama-decode-0", report_time=FRESH)]
    _, conditions = transfer_status(spec(), fleet()[1:2], agents, NOW)
    verified = cond(conditions, "TransportVerified")
    assert (verified.status, verified.reason) == (ConditionStatus.UNKNOWN, "NoTransportSeen")


def test_an_engine_that_does_not_export_its_transport_leaves_rdma_unverified() -> None:
    """Engine-native pods (their sidecar lists `transports` in `unknown`): RDMA is required
    but nothing can verify it, and the status says why instead of waiting for a report
    that never comes."""
    native = spec(engine={"framework": "vllm", "image": "v"},
                  transfer={"backend": "EngineNative"}, prefill={"parallelism": {"tensor": 2}},
                  decode={"parallelism": {"tensor": 2}})
    agents = [make_agent("llama-decode-0", report_time=FRESH, window=(10, 0)),
              make_agent("llama-prefill-0", role="prefill", report_time=FRESH)]
    for agent in agents:
        agent["status"]["unknown"] = ["transports", "ring"]
    _, conditions = transfer_status(native, fleet()[:2], agents, NOW)
    verified = cond(conditions, "TransportVerified")
    assert (verified.status, verified.reason) == (ConditionStatus.UNKNOWN,
                                                  "TransportNotExposed")
    assert verified.message == (
        "The vllm engine's own KV connector (transfer.backend EngineNative) does not export "
        "the transport it uses (llama-decode-0, llama-prefill-0 say so), so RDMA cannot be "
        "verified from the pods; use backend PDTransfer to have it verified.")


def test_staging_resizing_mismatch_near_capacity_and_not_in_use() -> None:
    _, conditions = transfer_status(spec(), fleet(), healthy_agents(resizing=True),
                                            NOW)
    pool = cond(conditions, "StagingPoolReady")
    assert (pool.status, pool.reason) == (ConditionStatus.FALSE, "Resizing")
    assert "llama-decode-1" in pool.message

    _, conditions = transfer_status(spec(), fleet(),
                                            healthy_agents(staging_mib=(3072, 2048)), NOW)
    pool = cond(conditions, "StagingPoolReady")
    assert (pool.status, pool.reason) == (ConditionStatus.FALSE, "SizeMismatch")
    assert "llama-decode-1 has 3072 MiB (want 4096)" in pool.message

    # 7600 of 8192 MiB used (93% > 90%): still True, with the recommended size.
    # per-rank high water = 7600 x 4096 / 8192 = 3800 MiB; x 1.25 = 4750 MiB;
    # rounded up to whole 1280 MiB chunks: ceil(4750 / 1280) = 4 -> 5120 MiB.
    full = {**RING, "usedBytes": 7600 * MIB, "highWaterBytes": 7600 * MIB}
    got, conditions = transfer_status(spec(), fleet(), healthy_agents(ring=full), NOW)
    pool = cond(conditions, "StagingPoolReady")
    assert (pool.status, pool.reason) == (ConditionStatus.TRUE, "NearCapacity")
    assert got.recommended_decode_pool_mib == 5120
    assert "decodePoolMiB: 5120 (5120 MiB = 4 × one prefill chunk" in pool.message
    assert "llama-decode-1" in pool.message

    waiting = {**RING, "pendingGrants": 2}
    _, conditions = transfer_status(spec(), fleet(), healthy_agents(ring=waiting), NOW)
    assert cond(conditions, "StagingPoolReady").reason == "NearCapacity"

    unstaged = make_spec()  # prefill TP1 == decode TP1: Auto does not stage
    got, conditions = transfer_status(unstaged, fleet(), healthy_agents(), NOW)
    pool = cond(conditions, "StagingPoolReady")
    assert (pool.status, pool.reason) == (ConditionStatus.TRUE, "NotInUse")
    assert got.recommended_decode_pool_mib is None


def test_recommended_pool_arithmetic() -> None:
    """max per-rank decode high water x 1.25, rounded up to whole chunks (1280 MiB, the
    admission minimum), at least one. Guards against the demo's 8 MiB pools (high water
    0.1 MiB) being told 256 MiB: the old 256 MiB rounding ignored the chunk size.
    decode-0: 5000 MiB high water over a 2-rank ring (8192 MiB capacity, 4096 per rank)
      -> 2500 MiB per rank -> x 1.25 = 3125 MiB -> ceil(3125 / 1280) = 3 -> 3840 MiB.
    decode-1: 600 MiB -> 300 per rank -> 375 -> 1 chunk = 1280 MiB."""
    def with_high_water(mib: int) -> dict[str, int]:
        return {**RING, "highWaterBytes": mib * MIB}

    pods = fleet()[1:]
    agents = [make_agent("llama-decode-0", report_time=FRESH, ring=with_high_water(5000)),
              make_agent("llama-decode-1", report_time=FRESH, ring=with_high_water(600))]
    got, _ = transfer_status(spec(), pods, agents, NOW)
    assert got.recommended_decode_pool_mib == 3840
    assert got.recommendation_basis == (
        "3840 MiB = 3 × one prefill chunk (1342177280 bytes per decode rank, rounded up to "
        "1280 MiB: the admission minimum): the highest per-rank decode occupancy, 2500.0 MiB "
        "(llama-decode-0), × 1.25 headroom = 3125.0 MiB, rounded up to whole chunks.")
    got, _ = transfer_status(spec(), pods[1:], agents[1:], NOW)
    assert got.recommended_decode_pool_mib == 1280
    # no occupancy observed yet: no evidence, no recommendation
    idle = [make_agent("llama-decode-0", report_time=FRESH, ring={**RING, "highWaterBytes": 0})]
    assert transfer_status(spec(), pods[:1], idle, NOW)[0] \
        .recommended_decode_pool_mib is None


def test_gate_changes_only_when_status_or_reason_changes() -> None:
    """One PATCH per real change: a steady state writes nothing to the pods; lastTransition
    moves only on a status flip; a new pod's first NoReport is not announced."""
    pods = [make_pod("llama-decode-0", role="decode", gated=True),
            make_pod("llama-decode-1", role="decode", gated=True),
            make_pod("llama-prefill-0", role="prefill")]  # no gate: left alone
    agents = healthy_agents(window=(40, 30), healthy=False)
    changes = {c.pod: c for c in transfer_gate_changes(observe(spec(), pods, agents))}
    assert sorted(changes) == ["llama-decode-0", "llama-decode-1"]
    assert changes["llama-decode-1"].condition["reason"] == "TransferFailing"
    assert changes["llama-decode-1"].announce and changes["llama-decode-1"].bad_news
    assert not changes["llama-decode-0"].announce  # first verdict, and a good one

    for pod in pods[:2]:
        pod["status"]["conditions"].append(dict(changes[pod["metadata"]["name"]].condition))
    later = NOW + timedelta(seconds=5)
    assert transfer_gate_changes(observe(spec(), pods, agents, later)) == []

    later = NOW + timedelta(seconds=30)
    (change,) = transfer_gate_changes(observe(spec(), pods, healthy_agents(), later))
    assert change.pod == "llama-decode-1" and change.announce and not change.bad_news
    assert change.condition["status"] == "True"
    assert change.condition["lastTransitionTime"] == "2024-05-01T12:00:30Z"


def test_demo_pools_are_not_told_256_mib() -> None:
    """The recommended pool size agrees with admission and with what runs: the
    local-reference demo (4 layers, 2 KV heads, head dim 32, bf16, 256-token chunks, prefill
    TP1 -> decode TP2, 8 MiB pools) with a 0.1 MiB high-water mark was told 256 MiB.
    One chunk per decode rank = 256 tokens × 1 head × 32 × 2 B × 2 × 4 layers = 131072 bytes
    -> 1 MiB (the admission minimum, which 8 MiB passes); 0.1 MiB × 1.25 = 0.125 MiB fits in
    one chunk -> 1 MiB, not 256. Guards against a recommendation that disagrees with
    admission and with what runs (docs/failure-modes.md #30)."""
    demo = make_spec(
        model={"numLayers": 4, "numKVHeads": 2, "headDim": 32, "kvDtype": "bfloat16"},
        prefill={"parallelism": {"tensor": 1}, "pageSize": 16, "chunkedPrefillTokens": 256},
        decode={"parallelism": {"tensor": 2}, "pageSize": 16},
        transfer={"staging": {"decodePoolMiB": 8, "prefillBufferMiB": 8}},
    )
    ring = {"capacityBytes": 16 * MIB, "usedBytes": 0,
            "highWaterBytes": round(0.2 * MIB), "pendingGrants": 0}  # 2 ranks × 8 MiB
    agents = [make_agent("llama-decode-0", report_time=FRESH, ring=ring,
                         staging_mib=(8, 8))]
    got, _ = transfer_status(demo, fleet()[1:2], agents, NOW)
    assert got.recommended_decode_pool_mib == 1
    assert got.recommendation_basis == (
        "1 MiB = one prefill chunk (131072 bytes per decode rank, rounded up to 1 MiB: the "
        "admission minimum); the highest per-rank decode occupancy, 0.1 MiB "
        "(llama-decode-0), × 1.25 headroom = 0.1 MiB, fits in it.")
