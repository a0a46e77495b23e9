"""The in-pod agent without NIXL or an API server: identity, report building, the reporter's
rate limiting / transitions / backoff (in-process fake API, manual clock), its staging resizes
(and that they agree with the operator's rollout planner), the UCX probe."""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pd_contract.transferagent import (
    AgentEndpoints,
    AgentStaging,
    PeerAgents,
    PeerTransport,
    Role,
    WindowCounts,
)
from pd_operator.staging_rollout.planner import StagingPod
from pd_testbed.agent_fakes import POD_ENV, FakeAgentAPI
from pd_testbed.checkout import UNIT_DATA_DIR
from pd_transfer.agent.errors import IdentityError, PermanentAPIError, RetryableAPIError
from pd_transfer.agent.identity import PodIdentity, read_identity
from pd_transfer.agent.report import (
    Connections,
    ReportFacts,
    RequestCounts,
    WindowSample,
    build_status,
    compute_window,
    connections_of,
    trim_samples,
    with_engine_requests,
)
from pd_transfer.agent.reporter import Reporter, ReporterTuning, build_transfer_agent
from pd_transfer.agent.spec_watch import SpecWatch
from pd_transfer.agent.transport_probe import (
    ProtoInfoParser,
    UcxLogTail,
    configure_environment,
    normalise_transport,
)
from pd_transfer.common.metrics import RecentFailure, RingWatermark, TransferSnapshot

DATA = UNIT_DATA_DIR
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def make_identity() -> PodIdentity:
    return read_identity(POD_ENV, started_unix_s=1000.5)


def make_facts(window_s: float = 10.0, ratio: float = 0.1) -> ReportFacts:
    return ReportFacts(identity=make_identity(),
                       endpoints=AgentEndpoints(bootstrap="10.0.0.7:8998", engine="10.0.0.7:8000",
                                                metrics="10.0.0.7:9400"),
                       staging=AgentStaging(decode_pool_mib=8, prefill_buffer_mib=8),
                       window_seconds=window_s, max_failure_ratio=ratio)


def make_snapshot(succeeded: int = 0, failed: int = 0, reasons: dict[str, int] | None = None,
                  ring: RingWatermark | None = None,
                  recent: tuple[RecentFailure, ...] = ()) -> TransferSnapshot:
    return TransferSnapshot(role="decode", succeeded=succeeded, failed=failed, live_requests=1,
                            bytes_transferred=100 * succeeded, failures_by_reason=reasons or {},
                            rejected_by_reason={}, recent_failures=recent, ring=ring)


# Identity ---------------------------------------------------------------------------------------

def test_identity_reads_downward_api_and_incarnation() -> None:
    ident = make_identity()
    assert (ident.name, ident.namespace, ident.uid, ident.ip, ident.role) == (
        "demo-decode-0", "ns", "uid-1", "10.0.0.7", "decode")
    assert ident.tensor_parallel == 2 and ident.pipeline_parallel == 1
    assert ident.incarnation == "uid-1-1000500"  # pod UID + start in ms


def test_identity_error_names_every_missing_variable() -> None:
    """Guards against fixing a hand-written pod spec one variable per restart."""
    env = {k: v for k, v in POD_ENV.items() if k not in ("POD_UID", "POD_IP")}
    env["PD_TENSOR_PARALLEL"] = "zero"
    with pytest.raises(IdentityError) as info:
        read_identity(env)
    message = str(info.value)
    assert "POD_UID is not set (downward API fieldRef metadata.uid)" in message
    assert "POD_IP is not set (downward API fieldRef status.podIP)" in message
    assert "PD_TENSOR_PARALLEL='zero'" in message


def test_identity_refuses_unknown_role() -> None:
    with pytest.raises(IdentityError, match="PD_ROLE='router' must be prefill or decode"):
        read_identity(POD_ENV | {"PD_ROLE": "router"})


# Report building ---------------------------------------------------------------------------------

def test_window_counts_only_the_last_window() -> None:
    # Cumulative: t=0 (0, 0), t=5 (10 transfers, 1 failure), t=12 (30, 4: 3 GrantTimeout).
    samples = [WindowSample(0.0, 0, 0), WindowSample(5.0, 10, 1, {"GrantTimeout": 1}),
               WindowSample(12.0, 30, 4, {"GrantTimeout": 3, "Aborted": 1})]
    # Window (2, 12]: baseline is the t=0 sample (newest at or before 2) -> all of it.
    assert compute_window(samples, 12.0, 10.0).transfers == 30
    # Window (5, 12]: baseline t=5 -> 20 transfers, 3 failures, 2 GrantTimeout + 1 Aborted.
    window = compute_window(samples, 12.0, 7.0)
    assert (window.transfers, window.failures) == (20, 3)
    assert window.failures_by_reason == {"GrantTimeout": 2, "Aborted": 1}
    # trimming keeps the baseline and everything after it; no window loses data
    assert trim_samples(samples, 12.0, 7.0) == samples[1:]


def test_window_counts_the_engines_requests_and_their_errors_where_it_counts_them() -> None:
    """Guards against a window that loses the engine's request errors, or invents counts
    for an engine that does not report them (an engine rollout judges new pods by them)."""
    # Cumulative: t=0 nothing counted yet, t=5 (8 ended, 1 error), t=12 (20 ended, 4 errors).
    samples = [WindowSample(0.0, 0, 0), WindowSample(5.0, 8, 0, {}, RequestCounts(8, 1)),
               WindowSample(12.0, 20, 0, {}, RequestCounts(20, 4))]
    since_start = compute_window(samples, 12.0, 10.0)  # baseline t=0 counted nothing: 0
    assert (since_start.requests, since_start.request_errors) == (20, 4)
    last = compute_window(samples, 12.0, 7.0)  # baseline t=5
    assert (last.requests, last.request_errors) == (12, 3)
    wire = last.to_wire()
    assert (wire["requests"], wire["requestErrors"]) == (12, 3)
    # An engine restarted inside the window counts again from 0: never a negative count.
    restarted = [*samples, WindowSample(14.0, 21, 0, {}, RequestCounts(1, 0))]
    assert compute_window(restarted, 14.0, 5.0).request_errors == 0
    # An engine whose agent cannot read them: absent, not 0.
    unknown = compute_window([WindowSample(0.0, 5, 1)], 1.0, 10.0)
    assert (unknown.requests, unknown.request_errors) == (None, None)
    assert "requests" not in unknown.to_wire() and "requestErrors" not in unknown.to_wire()


def test_build_status_sums_ranks_and_judges_health() -> None:
    ring = RingWatermark(capacity_bytes=100, used_bytes=10, free_bytes=90,
                         largest_free_extent_bytes=60, high_water_bytes=50,
                         pending_allocations=1, quarantined_bytes=0)
    failure = RecentFailure("room-7", "StalledWriter", "writer gone", 1_700_000_000.0)
    ranks = [make_snapshot(9, 1, {"StalledWriter": 1}, ring, (failure,)),
             make_snapshot(10, 0, None, ring)]
    window = compute_window([WindowSample(0.0, 20, 1, {"StalledWriter": 1})], 1.0, 10.0)
    status = build_status(make_facts(ratio=0.1), ranks,
                          [PeerTransport(peer="p-r0", transport="tcp")], window, NOW)
    assert status.transfers_total == 20 and status.failures_total == 1
    assert status.bytes_total == 1900
    assert status.ring.capacity_bytes == 200 and status.ring.high_water_bytes == 100
    assert status.ring.largest_free_extent_bytes == 60  # max over ranks, not a sum
    assert status.healthy is True  # 1 of 20 = 5% <= 10%
    assert status.recent_failures[0].pod == "demo-decode-0"
    assert status.last_error == "room room-7: writer gone"
    wire = status.to_wire()
    assert wire["podUID"] == "uid-1" and wire["incarnation"] == "uid-1-1000500"
    assert "" not in wire.values()  # the v1.20 server refuses "" in custom resources


def test_connections_group_peer_agents_by_pod_once_each() -> None:
    """Two ranks holding the same two prefill ranks (reference-engine instances carry the
    incarnation after "@", vLLM's are the pod name): one entry per pod, agents once, sorted."""
    ranks = [("d-r0", [("p0-r1", "prefill-0@uid-a-1"), ("p0-r0", "prefill-0@uid-a-1"),
                       ("q-r0", "prefill-1")]),
             ("d-r1", [("p0-r0", "prefill-0@uid-a-1"), ("p0-r1", "prefill-0@uid-a-1")])]
    held = connections_of(ranks)
    assert held == Connections(
        agents=("d-r0", "d-r1"),
        peers=(PeerAgents(pod="prefill-0", agents=["p0-r0", "p0-r1"]),
               PeerAgents(pod="prefill-1", agents=["q-r0"])))
    window = compute_window([WindowSample(0.0, 0, 0)], 1.0, 10.0)
    wire = build_status(make_facts(ratio=0.1), [], [], window, NOW,
                        connections=held).to_wire()
    assert wire["agents"] == ["d-r0", "d-r1"]
    assert wire["peers"] == [{"pod": "prefill-0", "agents": ["p0-r0", "p0-r1"]},
                             {"pod": "prefill-1", "agents": ["q-r0"]}]
    assert connections_of([]) == Connections()


def test_unhealthy_above_the_ratio_and_healthy_without_traffic() -> None:
    facts = make_facts(ratio=0.05)
    bad = compute_window([WindowSample(0.0, 10, 1)], 1.0, 10.0)  # 10% > 5%
    assert build_status(facts, [], [], bad, NOW).healthy is False
    idle = compute_window([WindowSample(0.0, 0, 0)], 1.0, 10.0)
    assert build_status(facts, [], [], idle, NOW).healthy is True


def test_failures_caused_by_a_peer_going_away_leave_the_pod_healthy() -> None:
    """Guards against a cascade: a decode killed mid-transfer failed the prefill's transfers
    with it, the prefill judged itself unhealthy, its readiness gate turned False and the
    router lost its only prefill (seen on the local cluster with vLLM)."""
    facts = make_facts(ratio=0.05)
    peer_gone = compute_window([WindowSample(0.0, 10, 4, {"PeerUnreachable": 2,
                                                          "LeaseExpired": 1,
                                                          "AbortedByPeer": 1})], 1.0, 10.0)
    assert build_status(facts, [], [], peer_gone, NOW).healthy is True  # own: 0 of 10
    own = compute_window([WindowSample(0.0, 10, 4, {"PeerUnreachable": 3,
                                                    "StalledWriter": 1})], 1.0, 10.0)
    assert build_status(facts, [], [], own, NOW).healthy is False  # own: 1 of 10 > 5%


# Reporter -----------------------------------------------------------------------------------------

class Source:
    def __init__(self) -> None:
        self.snaps = [make_snapshot()]
        self.reported_calls = 0

    def snapshots(self) -> list[TransferSnapshot]:
        return self.snaps

    def transports(self) -> list[PeerTransport]:
        return []

    def connections(self) -> Connections:
        return Connections()

    def reported(self) -> None:
        self.reported_calls += 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_reporter(api: FakeAgentAPI, source: Source, clock: Clock) -> Reporter:
    return Reporter(make_facts(ratio=0.1), source, api, ReporterTuning(report_interval_s=5.0),
                    clock=clock, wall=lambda: NOW, rng=random.Random(0))


def test_the_written_window_counts_the_engines_request_errors() -> None:
    """Guards the wiring from an agent's request counts to the status an engine rollout
    reads: each tick samples them, the written window holds what ended within it."""
    api, source, clock = FakeAgentAPI(), Source(), Clock()
    counts = [RequestCounts(0, 0)]
    reporter = Reporter(make_facts(ratio=0.1), source, api,
                        ReporterTuning(report_interval_s=5.0), clock=clock, wall=lambda: NOW,
                        rng=random.Random(0), requests=lambda: counts[0])
    assert reporter.tick() is True
    counts[0] = RequestCounts(12, 5)
    clock.now += 5.0
    assert reporter.tick() is True
    window = api.objects[("ns", "demo-decode-0")]["status"]["window"]
    assert (window["requests"], window["requestErrors"]) == (12, 5)


def test_the_engines_requests_are_read_once_per_write_not_once_per_tick() -> None:
    """Guards the engine's load (a vLLM pod agent's reading is an HTTP scrape of vLLM's
    /metrics, in the scheduler's process): read only when a status is written, and the
    written status carries exactly what that reading said."""
    api, source, clock = FakeAgentAPI(), Source(), Clock()
    readings = iter([4, 0])
    reads: list[float] = []

    def engine_requests() -> int | None:
        reads.append(clock.now)
        return next(readings)

    reporter = Reporter(make_facts(ratio=0.1), source, api,
                        ReporterTuning(report_interval_s=5.0), clock=clock, wall=lambda: NOW,
                        rng=random.Random(0), engine_requests=engine_requests)
    for _ in range(6):  # ticks at 100..105 s: writes at 100 and 105
        reporter.tick()
        clock.now += 1.0
    assert reads == [100.0, 105.0]
    assert [w.get("engineRequests") for w in api.status_writes] == [4, 0]
    assert [w.get("unknown", []) for w in api.status_writes] == [[], []]


@pytest.mark.parametrize("reading", [None, RuntimeError("engine metrics exploded")],
                         ids=["unreadable", "raising"])
def test_unread_engine_requests_are_written_as_unknown(reading: Exception | None) -> None:
    """Guards against a pod whose engine could not be read looking idle to the operator's
    scale-down choice: no engineRequests, and status.unknown lists it; a reading that raises
    does not stop the write."""
    api, source, clock = FakeAgentAPI(), Source(), Clock()

    def engine_requests() -> int | None:
        if isinstance(reading, Exception):
            raise reading
        return reading

    reporter = Reporter(make_facts(ratio=0.1), source, api,
                        ReporterTuning(report_interval_s=5.0), clock=clock, wall=lambda: NOW,
                        rng=random.Random(0), engine_requests=engine_requests)
    assert reporter.tick() is True
    written = api.status_writes[-1]
    assert "engineRequests" not in written
    assert written["unknown"] == ["engineRequests"]


def test_without_a_reading_of_its_engine_a_status_lists_its_requests_unknown() -> None:
    status = build_status(make_facts(), [make_snapshot()], [], WindowCounts(), NOW)
    assert (status.engine_requests, status.unknown) == (None, ["engineRequests"])
    assert "engineRequests" not in status.to_wire()
    counted = build_status(make_facts(), [], [], WindowCounts(), NOW, engine_requests=3)
    assert (counted.engine_requests, counted.unknown) == (3, [])
    assert counted.to_wire()["engineRequests"] == 3


def test_with_engine_requests_keeps_the_other_unknown_fields_sorted() -> None:
    status = build_status(make_facts(), [], [], WindowCounts(), NOW, engine_requests=2)
    status = status.model_copy(update={"unknown": ["agents", "ring"]})
    unread = with_engine_requests(status, None)
    assert (unread.engine_requests, unread.unknown) == (None, ["agents", "engineRequests",
                                                               "ring"])
    assert with_engine_requests(unread, 0).unknown == ["agents", "ring"]
    assert with_engine_requests(unread, 0).engine_requests == 0
    assert with_engine_requests(status, -1).engine_requests is None  # no count


def test_first_tick_creates_the_agent_owned_by_its_pod() -> None:
    api, source, clock = FakeAgentAPI(), Source(), Clock()
    reporter = make_reporter(api, source, clock)
    assert reporter.tick() is True
    obj = api.objects[("ns", "demo-decode-0")]
    assert obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "demo-decode-0", "uid": "uid-1"}]
    assert obj["metadata"]["labels"] == {"pd.serving.dev/deployment": "demo",
                                         "pd.serving.dev/role": "decode",
                                         "app.kubernetes.io/managed-by": "pd-transfer-agent"}
    assert obj["spec"] == {"pdDeployment": "demo", "role": "decode",
                           "staging": {"decodePoolMiB": 8, "prefillBufferMiB": 8},
                           "paused": False}
    assert obj["status"]["observedGeneration"] == 1  # its spec's staging is what runs
    assert source.reported_calls == 1


def test_writes_at_most_every_interval() -> None:
    """Guards against an agent that writes its status every tick (API server load)."""
    api, source, clock = FakeAgentAPI(), Source(), Clock()
    reporter = make_reporter(api, source, clock)
    for _ in range(20):  # 20 ticks of 1 s
        reporter.tick()
        clock.now += 1.0
    # written at t=100, 105, 110, 115: every 5 s
    assert len(api.status_writes) == 4
    assert api.calls.count("get") == 1  # resourceVersion reused, no read before each write


def test_health_transition_is_written_at_once_but_not_faster_than_the_gap() -> None:
    api, source, clock = FakeAgentAPI(), Source(), Clock()
    reporter = make_reporter(api, source, clock)
    reporter.tick()
    clock.now += 0.5
    source.snaps = [make_snapshot(5, 5, {"StalledWriter": 5})]  # 50% failures
    assert reporter.tick() is False  # within transition_gap_s of the last write
    clock.now += 0.6
    assert reporter.tick() is True  # 1.1 s after the last write, interval is 5 s
    assert api.status_writes[-1]["healthy"] is False
    assert api.status_writes[-1]["window"]["failuresByReason"] == {"StalledWriter": 5}


def test_backoff_grows_with_jitter_and_recovers() -> None:
    """The API server being down must neither spin the agent nor stop it for good."""
    api, source, clock = FakeAgentAPI(), Source(), Clock()
    reporter = make_reporter(api, source, clock)
    api.fail_next = [RetryableAPIError("down", 0) for _ in range(4)]
    attempts = []
    for _ in range(40):
        before = len(api.calls)
        reporter.tick()
        if len(api.calls) > before:
            attempts.append(clock.now)
        clock.now += 0.25
    gaps = [b - a for a, b in itertools.pairwise(attempts)][:4]
    # equal jitter: the n-th delay lies in [d/2, d] with d = 0.5 * 2^(n-1) s
    for n, gap in enumerate(gaps, start=1):
        d = 0.5 * 2 ** (n - 1)
        assert d / 2 <= gap <= d + 0.25, (n, gaps)
    assert api.status_writes, "the reporter recovered once the API server answered"
    assert reporter.failed_attempts == 4


def test_permanent_error_waits_the_cap_and_conflict_rereads() -> None:
    api, source, clock = FakeAgentAPI(), Source(), Clock()
    reporter = make_reporter(api, source, clock)
    api.fail_next = [PermanentAPIError("forbidden", 403)]
    reporter.tick()
    clock.now += 29.0
    assert reporter.tick() is False and len(api.calls) == 1  # still waiting the 30 s cap
    clock.now += 1.5
    assert reporter.tick() is True
    api.objects[("ns", "demo-decode-0")]["metadata"]["resourceVersion"] = "someone-else"
    clock.now += 5.0
    assert reporter.tick() is False  # 409: forget the resourceVersion
    clock.now += 1.0
    assert reporter.tick() is True and api.calls[-2:] == ["get", "replace_status"]


def test_recreates_a_deleted_agent() -> None:
    api, source, clock = FakeAgentAPI(), Source(), Clock()
    reporter = make_reporter(api, source, clock)
    reporter.tick()
    api.objects.clear()
    clock.now += 5.0

    def missing(body: dict[str, Any]) -> dict[str, Any]:
        raise PermanentAPIError("not found", 404)

    original = api.replace_status
    api.replace_status = missing  # type: ignore[method-assign]
    assert reporter.tick() is False
    api.replace_status = original  # type: ignore[method-assign]
    clock.now += 31.0
    assert reporter.tick() is True
    assert ("ns", "demo-decode-0") in api.objects


def test_transfer_agent_body_has_no_empty_strings() -> None:
    body = build_transfer_agent(make_facts())
    assert body["apiVersion"] == "pd.serving.dev/v1alpha1" and body["kind"] == "TransferAgent"

    def strings(value: Any) -> list[str]:
        if isinstance(value, dict):
            return [s for v in value.values() for s in strings(v)]
        if isinstance(value, list):
            return [s for v in value for s in strings(v)]
        return [value] if isinstance(value, str) else []

    assert "" not in strings(body)


# Transport probe (real lines captured from UCX 1.x under NIXL 1.5.1 on this test bed) -------------

def test_probe_reads_default_selection_cma_and_tcp() -> None:
    parser = ProtoInfoParser()
    parser.feed_lines((DATA / "ucx_proto_info_default.log").read_text().splitlines())
    # intra-node cfg#1: remote memory write over cma (data); tcp only for active messages
    assert parser.worker_transports("prefill-0-0-073b68ce") == ["cma"]
    assert parser.transports_for("prefill-0-0-073b68ce", ["decode-r0"]) == [
        PeerTransport(peer="decode-r0", transport="cma")]


def test_probe_matches_the_truncated_worker_name() -> None:
    """UCX prints 31 characters of a worker name; a long agent name must still match."""
    lines = [
        "[1.0] [h:1:0]   | r0-0123456789-local-reference-d intra-node cfg#1 |",
        "[1.0] [h:1:0]   | remote memory write by ucp_put* from host memory to host |",
        "[1.0] [h:1:0]   | 0..inf | zero-copy   | cma/memory                        |",
    ]
    parser = ProtoInfoParser()
    parser.feed_lines(lines)
    assert parser.worker_transports("r0-0123456789-local-reference-decode-0") == ["cma"]
    assert parser.worker_transports("r1-0123456789-local-reference-decode-0") == []


def test_probe_reads_forced_tcp() -> None:
    parser = ProtoInfoParser()
    parser.feed_lines((DATA / "ucx_proto_info_tcp.log").read_text().splitlines())
    assert parser.worker_transports("prefill-0-0-8c3b7308") == ["tcp"]
    assert parser.worker_transports("someone-else") == []


def test_probe_normalises_rdma_names_and_passes_other_lines() -> None:
    # Same table format as the captured lines, for an RDMA lane (no NIC on this test bed).
    lines = [
        "[1.0] [h:1:0]   | decode-r0 inter-node cfg#2                               |",
        "[1.0] [h:1:0]   | remote memory write by ucp_put* from host memory to host |",
        "[1.0] [h:1:0]   | 0..inf | zero-copy   | rc_mlx5/mlx5_0:1                  |",
    ]
    parser = ProtoInfoParser()
    parser.feed_lines(lines)
    assert parser.worker_transports("decode-r0") == ["rc"]
    assert parser.feed("[1.0] [h:1:0] UCX  WARN  some warning") is False
    assert [normalise_transport(n) for n in ("rc_mlx5", "dc_mlx5", "ud_verbs", "cuda_ipc",
                                             "TCP")] == ["rc", "dc", "ud", "cuda_ipc", "tcp"]


def test_log_tail_forwards_and_parses_incrementally(tmp_path: Path) -> None:
    log = tmp_path / "ucx.log"
    parser = ProtoInfoParser()
    tail = UcxLogTail(log, parser)
    assert tail.read_available() == 0  # not created yet
    lines = (DATA / "ucx_proto_info_tcp.log").read_text()
    log.write_text(lines[:200])  # a partial line stays buffered
    tail.read_available()
    with log.open("a") as handle:
        handle.write(lines[200:])
    tail.read_available()
    assert parser.worker_transports("prefill-0-0-8c3b7308") == ["tcp"]


def test_configure_environment_respects_the_user(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    path = configure_environment(env, tmp_path)
    assert env["UCX_PROTO_INFO"] == "y" and env["UCX_LOG_FILE"] == str(path)
    assert configure_environment({"UCX_PROTO_INFO": "n"}, tmp_path) is None
    assert configure_environment({"UCX_LOG_FILE": "/x/ucx-%p.log"}, tmp_path) is None


def test_a_spec_change_resizes_and_reports_each_transition() -> None:
    """The engine's resizer runs when spec.staging differs; resizing, then the new sizes,
    stagingSince, registrationVersion and observedGeneration are written at once."""
    api, source, clock = FakeAgentAPI(), Source(), Clock()
    asked: list[tuple[AgentStaging, Future[int]]] = []

    def resizer(staging: AgentStaging) -> Future[int]:
        asked.append((staging, Future()))
        return asked[-1][1]

    later = datetime(2026, 1, 1, 12, 5, tzinfo=UTC)
    walls = iter([NOW] * 3 + [later] * 50)
    reporter = Reporter(make_facts(), source, api, ReporterTuning(report_interval_s=5.0),
                        clock=clock, wall=lambda: next(walls), rng=random.Random(0),
                        resizer=resizer)
    assert reporter.tick()
    assert not asked and api.status_writes[-1]["observedGeneration"] == 1
    obj = next(iter(api.objects.values()))
    obj["spec"]["staging"]["decodePoolMiB"] = 128
    obj["metadata"]["generation"] = 2
    clock.now += 1
    assert not reporter.tick()  # the spec is polled at the report interval
    clock.now += 5
    assert reporter.tick()  # a transition is written at once
    assert len(asked) == 1 and asked[0][0].decode_pool_mib == 128
    status = api.status_writes[-1]
    assert status["resizing"] is True and status["observedGeneration"] == 1
    assert status["staging"]["decodePoolMiB"] != 128
    clock.now += 1
    assert not reporter.tick()
    asked[0][1].set_result(2)
    clock.now += 1
    assert reporter.tick()
    status = api.status_writes[-1]
    assert status["resizing"] is False and status["staging"]["decodePoolMiB"] == 128
    assert status["registrationVersion"] == 2 and status["observedGeneration"] == 2
    assert status["stagingSince"].startswith("2026-01-01T12:05")
    # A failed resize keeps the old sizes, reports lastError and is not retried.
    obj["spec"]["staging"]["decodePoolMiB"] = 256
    obj["metadata"]["generation"] = 3
    clock.now += 6
    assert reporter.tick() and len(asked) == 2
    asked[1][1].set_exception(RuntimeError("out of device memory"))
    clock.now += 1
    assert reporter.tick()
    status = api.status_writes[-1]
    assert status["resizing"] is False and status["staging"]["decodePoolMiB"] == 128
    assert "out of device memory" in status["lastError"] and status["observedGeneration"] == 2
    clock.now += 6
    reporter.tick()
    assert len(asked) == 2  # same generation: no retry
    obj["spec"]["paused"] = True
    obj["spec"]["staging"]["decodePoolMiB"] = 512
    obj["metadata"]["generation"] = 4
    clock.now += 6
    reporter.tick()
    assert len(asked) == 2  # paused: no resize


def test_a_notified_spec_resizes_at_the_next_tick_without_waiting_for_the_poll() -> None:
    """Guards the rollout's pace: a spec change pushed by the watch (`notify_spec`) starts
    the resize at the very next tick, not at the next spec poll (report interval)."""
    api, source, clock = FakeAgentAPI(), Source(), Clock()
    asked: list[AgentStaging] = []

    def resizer(staging: AgentStaging) -> Future[int]:
        asked.append(staging)
        return Future()

    reporter = Reporter(make_facts(), source, api, ReporterTuning(report_interval_s=5.0),
                        clock=clock, wall=lambda: NOW, rng=random.Random(0), resizer=resizer)
    assert reporter.tick()
    obj = copy.deepcopy(next(iter(api.objects.values())))
    obj["spec"]["staging"]["decodePoolMiB"] = 96
    obj["metadata"]["generation"] = 2
    gets = api.calls.count("get")
    clock.now += 1  # well inside the poll interval
    reporter.notify_spec(obj)
    assert reporter.tick()  # the resizing report goes out at once
    assert [s.decode_pool_mib for s in asked] == [96]
    assert api.calls.count("get") == gets  # no extra GET: the watch brought the object
    assert api.status_writes[-1]["resizing"] is True


class ScriptedStream:
    """A `SpecStream` that plays one outcome per call: a list of objects, or an error."""

    def __init__(self, watch: list[SpecWatch], script: list[list[dict[str, Any]] | Exception]
                 ) -> None:
        self.watch, self.script = watch, script
        self.calls: list[str | None] = []

    def __call__(self, version: str | None, timeout_s: float) -> Iterator[dict[str, Any]]:
        self.calls.append(version)
        if not self.script:
            self.watch[0].stop(timeout_s=0)
            return
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        yield from step


def _version(v: str) -> dict[str, Any]:
    return {"metadata": {"resourceVersion": v}, "spec": {}}


def test_spec_watch_resumes_from_the_last_version_and_relists_after_410() -> None:
    """Guards against a watch that replays from scratch after each server timeout (every
    event again) or retries a compacted version forever."""
    seen: list[str] = []
    holder: list[SpecWatch] = []
    stream = ScriptedStream(holder, [
        [_version("5"), _version("7")],          # the server ends the watch after two events
        [_version("9")],                         # resumed from 7
        RetryableAPIError("too old resource version", 410),
        RetryableAPIError("connection refused", 0),
        [_version("12")],                        # a fresh watch (version None)
    ])
    watch = SpecWatch(stream, lambda obj: seen.append(obj["metadata"]["resourceVersion"]),
                      backoff_base_s=0.001, backoff_max_s=0.002, rng=random.Random(0))
    holder.append(watch)
    watch.run()
    assert seen == ["5", "7", "9", "12"]
    assert stream.calls == [None, "7", "9", None, None, "12"]
    assert (watch.events, watch.errors) == (4, 2)


@pytest.mark.parametrize(("role", "field"), [("decode", "prefillBufferMiB"),
                                             ("prefill", "decodePoolMiB")])
def test_a_spec_that_moves_only_the_other_roles_size_is_confirmed_at_once(
        role: str, field: str) -> None:
    """Lets a rollout skip pods whose size does not change, and guards
    docs/failure-modes.md #30: a spec change that leaves the size this pod allocates as it
    is (a decode pod's ring is decodePoolMiB, a prefill pod's buffer prefillBufferMiB) is
    confirmed by the very next report, never through the resizer, never `resizing: true`,
    so the rollout need not walk the pod through a resize; and the status never says the
    new sizes before the pod has taken them."""
    api, source, clock = FakeAgentAPI(), Source(), Clock()
    asked: list[AgentStaging] = []

    def resizer(staging: AgentStaging) -> Future[int]:
        asked.append(staging)
        return Future()

    facts = make_facts()
    facts = replace(facts, identity=replace(facts.identity, role=role))
    later = datetime(2026, 1, 1, 12, 5, tzinfo=UTC)
    walls = iter([NOW] * 3 + [later] * 50)
    reporter = Reporter(facts, source, api, ReporterTuning(report_interval_s=5.0),
                        clock=clock, wall=lambda: next(walls), rng=random.Random(0),
                        resizer=resizer)
    assert reporter.tick()
    first = api.status_writes[-1]
    assert first["staging"] == {"decodePoolMiB": 8, "prefillBufferMiB": 8}
    obj = copy.deepcopy(next(iter(api.objects.values())))
    obj["spec"]["staging"][field] = 16
    obj["metadata"]["generation"] = 2
    clock.now += 1
    reporter.notify_spec(obj)
    assert reporter.tick()  # written at once: a transition
    status = api.status_writes[-1]
    assert asked == []
    assert status["resizing"] is False
    assert status["staging"] == {"decodePoolMiB": 8, "prefillBufferMiB": 8} | {field: 16}
    assert status["observedGeneration"] == 2
    assert status["stagingSince"] == first["stagingSince"]
    assert status["registrationVersion"] == first["registrationVersion"]
    assert [w["resizing"] for w in api.status_writes] == [False, False]
    # The size this role allocates still goes through the resizer.
    mine = "decodePoolMiB" if role == "decode" else "prefillBufferMiB"
    obj["spec"]["staging"][mine] = 32
    obj["metadata"]["generation"] = 3
    clock.now += 1
    reporter.notify_spec(obj)
    assert reporter.tick()
    assert asked == [AgentStaging.model_validate(obj["spec"]["staging"])]
    assert api.status_writes[-1]["resizing"] is True


# The sizes a spec may ask of a pod running 8/8 MiB: neither, either or both changed.
SPEC_SIZES = [AgentStaging(decode_pool_mib=d, prefill_buffer_mib=p)
              for d, p in ((8, 8), (16, 8), (8, 16), (16, 16))]


@pytest.mark.parametrize(("role", "resized"), [("decode", [False, True, False, True]),
                                               ("prefill", [False, False, True, True])])
def test_the_agent_resizes_exactly_the_pods_the_rollout_planner_counts_as_resizing(
        role: str, resized: list[bool]) -> None:
    """The pod's agent (which resizes or only confirms a spec) and the operator's rollout
    planner (which batches, analyses and counts under maxUnavailable only resizing pods) must
    agree on which size a role allocates: decode the ring, prefill the buffer (`resized`,
    worked out by hand). Guards against the two sides drifting apart: the planner would count
    a merely confirming pod against maxUnavailable, or wait on a pod that resizes as if it
    would confirm at once."""
    in_force = make_facts().staging
    for spec_size, expected in zip(SPEC_SIZES, resized, strict=True):
        api, source, clock = FakeAgentAPI(), Source(), Clock()
        asked: list[AgentStaging] = []

        def resizer(staging: AgentStaging, asked: list[AgentStaging] = asked) -> Future[int]:
            asked.append(staging)
            return Future()

        facts = make_facts()
        facts = replace(facts, identity=replace(facts.identity, role=role))
        reporter = Reporter(facts, source, api, ReporterTuning(report_interval_s=5.0),
                            clock=clock, wall=lambda: NOW, rng=random.Random(0),
                            resizer=resizer)
        assert reporter.tick()
        obj = copy.deepcopy(next(iter(api.objects.values())))
        obj["spec"]["staging"] = spec_size.to_wire()
        obj["metadata"]["generation"] = 2
        clock.now += 1
        reporter.notify_spec(obj)
        reporter.tick()
        agent_resizes = asked == [spec_size]
        pod = StagingPod(name="p", role=Role(role), uid="u", spec=spec_size,
                                 reported=in_force)
        assert (agent_resizes, pod.is_resizing) == (expected, expected), spec_size
        assert api.status_writes[-1]["resizing"] is expected


def test_join_resizes_gives_the_rings_version_or_the_first_ranks_error() -> None:
    from concurrent.futures import Future  # noqa: PLC0415
    from dataclasses import dataclass  # noqa: PLC0415

    from pd_transfer.agent.reporter import join_resizes  # noqa: PLC0415

    @dataclass(frozen=True)
    class Done:
        registration_version: int
        side: str

    def futures(*outcomes: Done | Exception) -> list[Future[Done]]:
        out: list[Future[Done]] = [Future() for _ in outcomes]
        joined = join_resizes(out)
        for future, outcome in zip(out, outcomes, strict=True):
            assert not joined.done()  # only once every rank answered
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        out.append(joined)  # type: ignore[arg-type]
        return out

    assert futures(Done(3, "ring"), Done(5, "ring"), Done(0, "buffer"))[-1].result() == 5
    assert futures(Done(0, "buffer"))[-1].result() == 0
    joined = futures(Done(3, "ring"), RuntimeError("rank 1"), RuntimeError("rank 2"))[-1]
    assert str(joined.exception()) == "rank 1"
    assert join_resizes([]).result() == 0
