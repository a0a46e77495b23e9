"""The vLLM pod agent without vLLM: rank control routes on real bootstrap servers (real
sender/receiver state machines over the loopback transport, stepped by their worker
threads), the pod agent reading them over HTTP, the reporter writing into an in-process
fake API server (``pd_testbed.agent_fakes.FakeAgentAPI``)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pd_contract.config import TransferConfig
from pd_contract.transferagent import AgentStaging, PeerTransport, WindowCounts
from pd_testbed.agent_fakes import POD_ENV, FakeAgentAPI
from pd_testbed.transfer_harness import TEST_AUTH, Cluster
from pd_transfer.agent.identity import read_identity
from pd_transfer.agent.report import RequestCounts, build_status
from pd_transfer.common.metrics import PendingKV, RecentFailure, RingWatermark, TransferSnapshot
from pd_transfer.errors import BootstrapError
from pd_transfer.rank.worker import Worker
from pd_transfer.trust.auth import PeerAuth, Purpose
from pd_transfer.trust.bootstrap import BootstrapServer, fetch_document, open_document
from pd_transfer.vllm.pod_agent import (
    LIVE_REQUESTS,
    RANK_REACHABLE,
    PodAgent,
    PodAgentOptions,
    rank_host,
)
from pd_transfer.vllm.rank_control import (
    CONTROL_VERSION,
    REPORT_ROUTE,
    STAGING_ROUTE,
    ControlError,
    ControlRequest,
    RankControl,
    RankReport,
    SnapshotDoc,
    StagingReply,
    StagingRequest,
    fetch_report,
    open_control,
    post_staging,
    seal_control,
)

MIB = 1 << 20
CONFIG = TransferConfig.model_validate({
    "version": 1, "deployment": "demo", "namespace": "ns",
    "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "kv_dtype": "bfloat16",
              "attention": "MHA"},
    "prefill": {"tensor": 2, "pipeline": 1, "data": 1, "page_size": 4, "service": "p"},
    "decode": {"tensor": 2, "pipeline": 1, "data": 1, "page_size": 4, "service": "d"},
    "layer_pipeline": {"enabled": False, "min_tokens": 8, "min_groups": 2, "max_groups": 4,
                       "saturation": 4.0},
    "staging": {"mode": "Auto", "prefill_buffer_mib": 8, "decode_pool_mib": 8},
    "timeouts": {"bootstrap_seconds": 2.0, "grant_seconds": 1.0, "transfer_seconds": 5.0,
                 "kv_lease_seconds": 5.0},
    "reporting": {"report_interval_seconds": 5.0, "window_seconds": 60.0,
                  "max_failure_ratio": 0.05},
    "network": {"rdma_required": False, "bootstrap_port": 1, "metrics_port": 1},
})


def free_ports(count: int) -> int:
    """A base port with ``count`` free ports from it (rank r listens on base + r)."""
    for _ in range(100):
        with closing(socket.socket()) as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + count > 65535:
            continue
        try:
            for port in range(base, base + count):
                with closing(socket.socket()) as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise AssertionError("no run of free ports")


def options(base: int, tp: int = 2, role: str = "decode") -> PodAgentOptions:
    return PodAgentOptions(role=role, tp_size=tp, config=CONFIG,  # type: ignore[arg-type]
                           auth=TEST_AUTH, bootstrap_port=base, metrics_port=0,
                           metrics_host="127.0.0.1", engine_port=8000, fetch_timeout_s=1.0)


def snapshot(rank: int, staging_mib: int = 8) -> TransferSnapshot:
    """Rank r's hand-made counters (rank 0: 3 ok, 1 failed; rank 1: 5 ok, 2 failed)."""
    failed = 1 + rank
    return TransferSnapshot(
        role="decode", succeeded=3 + 2 * rank, failed=failed, live_requests=rank,
        bytes_transferred=1000 * (rank + 1),
        failures_by_reason={"GrantTimeout": 1, **({"PeerLost": rank} if rank else {})},
        rejected_by_reason={"unauthenticated": rank},
        recent_failures=(RecentFailure(f"room-{rank}", "GrantTimeout", "late", 100.0 + rank),),
        ring=RingWatermark(capacity_bytes=8 * MIB, used_bytes=MIB * rank, free_bytes=8 * MIB,
                           largest_free_extent_bytes=(4 + rank) * MIB,
                           high_water_bytes=2 * MIB, pending_allocations=rank,
                           quarantined_bytes=0),
        staging_bytes=staging_mib * MIB, registration_version=1, staging_since_unix_s=None,
        refused_transitions={}, pending=PendingKV(2 + rank, 4096 * (rank + 1), 0.5 + rank))


def canned_report(rank: int, staging_mib: int = 8) -> RankReport:
    return RankReport(
        tp_rank=rank, snapshot=SnapshotDoc.of(snapshot(rank, staging_mib)),
        transports=(PeerTransport(peer="prefill-a", transport="tcp"),
                    PeerTransport(peer=f"prefill-{rank}", transport="cma")),
        live_requests=4 + rank,
        metrics_text=f'# HELP pd_transfer_bytes KV bytes\n# TYPE pd_transfer_bytes counter\n'
                     f'pd_transfer_bytes_total{{path="staged"}} {1000 * (rank + 1)}.0\n')


@contextmanager
def canned_ranks(base: int, ranks: list[int],
                 staging: Callable[[int], StagingReply] | None = None,
                 staging_mib: Callable[[int], int] = lambda _rank: 8,
                 ) -> Iterator[list[BootstrapServer]]:
    """Bootstrap servers at base + r answering hand-made reports (and staging replies)."""
    cluster = Cluster(host="127.0.0.1")  # documents are fetched over HTTP
    servers = []
    for rank in ranks:
        server = BootstrapServer(cluster.receivers[0].document, TEST_AUTH, "127.0.0.1",
                                 base + rank)
        server.add_route("GET", REPORT_ROUTE, lambda _b, r=rank: (200, seal_control(
            canned_report(r, staging_mib(r)), TEST_AUTH, tp_rank=r, route=REPORT_ROUTE,
            reply=True)))
        if staging is not None:
            server.add_route("POST", STAGING_ROUTE, lambda _b, r=rank: (200, seal_control(
                staging(r), TEST_AUTH, tp_rank=r, route=STAGING_ROUTE, reply=True)))
        servers.append(server)
    try:
        yield servers
    finally:
        for server in servers:
            server.close()


@contextmanager
def live_ranks(base: int, tp: int = 2, transfers: int = 0) -> Iterator[Cluster]:
    """``tp`` real decode ranks (loopback), each stepped by a worker thread, each with a
    bootstrap server at base + r carrying its control routes; ``transfers`` requests moved
    (stepped by hand) before the threads start."""
    cluster = Cluster(decode_tp=tp, prefill_tp=tp, host="127.0.0.1")
    for _ in range(transfers):
        request = cluster.new_request(16)
        cluster.start(request)
        cluster.run(lambda r=request: cluster.finished(r.room))
        assert cluster.verified(request)
    workers = [Worker(e, f"test-{i}").start() for i, e in enumerate(cluster.endpoints)]
    servers = []
    for rank, receiver in enumerate(cluster.receivers):
        server = BootstrapServer(receiver.document, TEST_AUTH, "127.0.0.1", base + rank)
        RankControl(receiver, TEST_AUTH, live_requests=lambda: 0, probe=None,
                    transfer_timeout_s=5.0).install(server)
        servers.append(server)
    try:
        yield cluster
    finally:
        for server in servers:
            server.close()
        for worker in workers:
            worker.stop()


def scrape(agent: PodAgent) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(agent.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# The wire ---------------------------------------------------------------------------------------

def test_rank_report_round_trips_through_a_control_frame() -> None:
    report = canned_report(1)
    frame = seal_control(report, TEST_AUTH, tp_rank=1, route=REPORT_ROUTE, reply=True)
    opened = open_control(frame, RankReport, TEST_AUTH, tp_rank=1, route=REPORT_ROUTE,
                          reply=True)
    assert opened == report
    assert opened.snapshot.to_snapshot() == snapshot(1)
    assert opened.v == CONTROL_VERSION


def test_a_frame_of_another_key_purpose_rank_route_or_direction_is_refused() -> None:
    report = canned_report(0)
    body = report.model_dump_json().encode()
    other_key = seal_control(report, PeerAuth.generate(), tp_rank=0, route=REPORT_ROUTE,
                             reply=True)
    as_document = TEST_AUTH.seal(body, purpose=Purpose.DOCUMENT, version=CONTROL_VERSION,
                                 sender="rank-0/v1/rank/report", receiver="pod-agent")
    good = seal_control(report, TEST_AUTH, tp_rank=0, route=REPORT_ROUTE, reply=True)
    for frame, kwargs in [
        (other_key, {"tp_rank": 0, "route": REPORT_ROUTE, "reply": True}),
        (as_document, {"tp_rank": 0, "route": REPORT_ROUTE, "reply": True}),
        (good, {"tp_rank": 1, "route": REPORT_ROUTE, "reply": True}),  # another rank's
        (good, {"tp_rank": 0, "route": STAGING_ROUTE, "reply": True}),  # another route's
        (good, {"tp_rank": 0, "route": REPORT_ROUTE, "reply": False}),  # reflected
    ]:
        with pytest.raises(ControlError, match="MAC matches none"):
            open_control(frame, RankReport, TEST_AUTH, **kwargs)  # type: ignore[arg-type]
    # ... and a control frame is no bootstrap document either.
    with pytest.raises(BootstrapError, match="unauthenticated bootstrap document"):
        open_document(good, TEST_AUTH, "test")


def test_a_rank_refuses_forged_stale_and_oversized_control_requests() -> None:
    base = free_ports(1)
    with live_ranks(base, tp=1) as cluster:
        address = f"127.0.0.1:{base}"
        staging = AgentStaging(decode_pool_mib=1, prefill_buffer_mib=1)
        with pytest.raises(ControlError, match=r"answered 401.*MAC matches none"):
            post_staging(address, 0, staging, PeerAuth.generate(), 5.0)
        stale = seal_control(StagingRequest(staging=staging, issued_unix_s=time.time() - 60),
                             TEST_AUTH, tp_rank=0, route=STAGING_ROUTE, reply=False)
        too_big = seal_control(ControlRequest(), TEST_AUTH, tp_rank=0, route=STAGING_ROUTE,
                               reply=False) + b" " * 8192
        for body, status, text in [(stale, 401, "issued 60 s ago"),
                                   (too_big, 413, "at most 4096 are read")]:
            request = urllib.request.Request(f"http://{address}{STAGING_ROUTE}", data=body)
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(request, timeout=5)
            assert caught.value.code == status
            assert text in caught.value.read().decode()
        assert cluster.receivers[0].ring.capacity_bytes == cluster.ring_bytes  # untouched
        # The document route is as it was.
        assert fetch_document(address, 2.0, TEST_AUTH).tp_rank == 0


# The pod's report -------------------------------------------------------------------------------

def test_the_pod_report_merges_every_rank() -> None:
    base = free_ports(2)
    with canned_ranks(base, [0, 1]):
        agent = PodAgent(options(base), scheduler_live=lambda: 3)
        agent.refresh()
        assert agent.unreadable() == {}
        facts = agent.facts(read_identity(POD_ENV, started_unix_s=1.0))
        status = build_status(facts, agent.snapshots(), agent.transports(),
                              WindowCounts(seconds=60), datetime(2026, 1, 1, tzinfo=UTC))
    assert status.bytes_total == 1000 + 2000
    assert status.transfers_total == (3 + 1) + (5 + 2)
    assert status.failures_total == 1 + 2
    assert status.failures_by_reason == {"GrantTimeout": 2, "PeerLost": 1}
    assert status.live_requests == 0 + 1  # the endpoints' own count, as the engine reports
    assert status.ring.capacity_bytes == 16 * MIB
    assert status.ring.used_bytes == 1 * MIB
    assert status.ring.high_water_bytes == 4 * MIB
    assert status.ring.largest_free_extent_bytes == 5 * MIB
    assert status.ring.pending_grants == 1
    # Every rank holds its share of the same requests: the most of any rank, bytes summed.
    assert status.pending_kv.model_dump() == {"requests": 3, "bytes": 4096 + 8192,
                                              "oldest_seconds": 1.5}
    assert [f.message for f in status.recent_failures] == ["room room-1: late",
                                                            "room room-0: late"]
    assert sorted((t.peer, t.transport) for t in status.transports) == [
        ("prefill-0", "cma"), ("prefill-1", "cma"), ("prefill-a", "tcp")]
    assert status.endpoints.bootstrap == f"10.0.0.7:{base}"
    assert status.endpoints.engine == "10.0.0.7:8000"


def test_an_unreachable_rank_is_reported_as_such_never_as_zeros() -> None:
    base = free_ports(2)
    api = FakeAgentAPI()
    with canned_ranks(base, [0]) as servers:
        agent = PodAgent(options(base), scheduler_live=lambda: 0)
        agent.refresh()
        assert [s.bytes_transferred for s in agent.snapshots()] == [1000]  # rank 1: nothing
        assert list(agent.unreadable()) == [1]
        assert f"cannot reach http://127.0.0.1:{base + 1}" in agent.unreadable()[1]
        metrics = scrape(agent)
        assert metrics[(RANK_REACHABLE, (("rank", "0"),))] == 1.0
        assert metrics[(RANK_REACHABLE, (("rank", "1"),))] == 0.0
        assert not any(dict(labels).get("rank") == "1" and name != RANK_REACHABLE
                       for name, labels in metrics)
        agent.start(environ=POD_ENV, client_factory=lambda: api)
        try:
            deadline = time.monotonic() + 10
            while not api.status_writes and time.monotonic() < deadline:
                time.sleep(0.05)
            written = api.status_writes[0]
            assert written["healthy"] is False
            assert written["lastError"].startswith(f"rank 1 (127.0.0.1:{base + 1}) unreadable")
            assert written["bytesTotal"] == 1000
            # A rank that answered before and stops keeps its last counters (they only grow).
            servers[0].close()
            agent.refresh()
            assert sorted(agent.unreadable()) == [0, 1]
            assert [s.bytes_transferred for s in agent.snapshots()] == [1000]
        finally:
            agent.stop()


def test_one_slow_read_is_not_a_failure_a_rank_unread_past_the_grace_is() -> None:
    """Guards against a false alarm that rolled a staging rollout back: a rank busy
    re-registering its resized ring missed one 2-s report fetch, and the pod agent wrote
    healthy: false at once."""
    base = free_ports(2)
    now = [1000.0]
    with canned_ranks(base, [0, 1]) as servers:
        agent = PodAgent(options(base), scheduler_live=lambda: 0, clock=lambda: now[0])
        agent.refresh()
        assert agent.unhealthy_ranks() == {}
        servers[1].close()
        now[0] += 1.0
        agent.refresh()  # rank 1 missed one read
        assert list(agent.unreadable()) == [1]
        assert agent.unhealthy_ranks() == {}
        now[0] += agent.options.unread_grace_s
        assert list(agent.unhealthy_ranks()) == [1]  # unread past the grace
    never = PodAgent(options(free_ports(2)), scheduler_live=lambda: 0, clock=lambda: now[0])
    assert sorted(never.unhealthy_ranks()) == [0, 1]  # never read: nothing to vouch for


def test_without_identity_reporting_is_off_and_metrics_are_still_served(
        caplog: pytest.LogCaptureFixture) -> None:
    base = free_ports(2)
    with canned_ranks(base, [0, 1]):
        agent = PodAgent(options(base), scheduler_live=lambda: 2,
                         scheduler_requests=lambda: RequestCounts(9, 2)).start(environ={})
        try:
            deadline = time.monotonic() + 10
            while not agent.reporting_off and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "POD_NAME is not set" in agent.reporting_off
            assert agent.reporter is None
            assert "transfer health reporting is OFF" in caplog.text
            port = agent._metrics.server_address[1]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        finally:
            agent.stop()
    assert 'pd_transfer_connector_live_requests{side="scheduler"} 2.0' in text
    assert 'pd_transfer_connector_live_requests{rank="0",side="rank"} 4.0' in text
    assert 'pd_transfer_connector_live_requests{rank="1",side="rank"} 5.0' in text
    assert "pd_transfer_connector_requests_total 9.0" in text
    assert "pd_transfer_connector_request_errors_total 2.0" in text
    assert 'pd_transfer_bytes_total{path="staged",rank="0"} 1000.0' in text
    assert 'pd_transfer_bytes_total{path="staged",rank="1"} 2000.0' in text


def test_metrics_of_live_ranks_carry_exact_names_and_labels() -> None:
    base = free_ports(2)
    with live_ranks(base) as cluster:
        cluster.receivers[1].metrics.bytes_moved("staged", 4096)
        agent = PodAgent(options(base), scheduler_live=lambda: 0)
        agent.refresh()
        metrics = scrape(agent)
    assert metrics[(LIVE_REQUESTS, (("side", "scheduler"),))] == 0.0
    assert metrics[(LIVE_REQUESTS, (("rank", "0"), ("side", "rank")))] == 0.0
    assert metrics[(LIVE_REQUESTS, (("rank", "1"), ("side", "rank")))] == 0.0
    assert metrics[("pd_transfer_bytes_total", (("path", "staged"), ("rank", "1")))] == 4096.0
    assert metrics[("pd_transfer_ring_capacity_bytes", (("rank", "0"),))] == cluster.ring_bytes


# Resizes -------------------------------------------------------------------------------------

def test_a_resize_reaches_every_rank_and_yields_the_new_registration_version() -> None:
    base = free_ports(2)
    with live_ranks(base) as cluster:
        agent = PodAgent(options(base), scheduler_live=lambda: 0)
        before = [r.metrics.snapshot().registration_version for r in cluster.receivers]
        version = agent.resize_staging(
            AgentStaging(decode_pool_mib=1, prefill_buffer_mib=8)).result(20)
        assert [r.ring.capacity_bytes for r in cluster.receivers] == [MIB, MIB]
        after = [r.metrics.snapshot().registration_version for r in cluster.receivers]
        assert after == [v + 1 for v in before]
        assert version == max(before) + 1
        agent.refresh()
        assert [s.staging_bytes for s in agent.snapshots()] == [MIB, MIB]


def test_the_agent_reports_a_transfer_and_applies_a_spec_resize_to_every_rank() -> None:
    """The non-Kubernetes part of the pod agent's round trip (the API server is the
    in-process FakeAgentAPI): create + status with the bytes moved, then a spec change."""
    base = free_ports(2)
    api = FakeAgentAPI()
    with live_ranks(base, transfers=2) as cluster:
        moved = sum(r.metrics.snapshot().bytes_transferred for r in cluster.receivers)
        assert moved > 0
        agent = PodAgent(options(base), scheduler_live=lambda: 0).start(
            environ=POD_ENV, client_factory=lambda: api)
        try:
            wait(lambda: api.status_writes)
            created = api.objects[("ns", "demo-decode-0")]
            assert created["spec"]["staging"] == {"decodePoolMiB": 8, "prefillBufferMiB": 8}
            first = api.status_writes[0]
            assert (first["bytesTotal"], first["transfersTotal"]) == (moved, 2 * 2)
            assert first["healthy"] is True
            # The harness's prefill ranks are instance "p0": every decode rank holds both.
            assert first["agents"] == sorted(r.transport.agent_name for r in cluster.receivers)
            assert first["peers"] == [{"pod": "p0", "agents": sorted(
                s.transport.agent_name for s in cluster.senders)}]
            assert first["endpoints"] == {"bootstrap": f"10.0.0.7:{base}",
                                          "engine": "10.0.0.7:8000", "metrics": "10.0.0.7:0"}
            created["spec"]["staging"] = {"decodePoolMiB": 1, "prefillBufferMiB": 8}
            created["metadata"]["generation"] = 2
            assert agent.reporter is not None
            agent.reporter.notify_spec(created)
            wait(lambda: any(w.get("registrationVersion") == 2 and not w.get("resizing")
                             for w in api.status_writes))
            assert [r.ring.capacity_bytes for r in cluster.receivers] == [MIB, MIB]
            last = api.status_writes[-1]
            assert last["staging"] == {"decodePoolMiB": 1, "prefillBufferMiB": 8}
            assert last["observedGeneration"] == 2
        finally:
            agent.stop()


@pytest.mark.parametrize(("held_mib", "reported"), [
    ((4, 4), {"decodePoolMiB": 4, "prefillBufferMiB": 8}),  # the ranks' size is in force
    ((8, 8), {"decodePoolMiB": 8, "prefillBufferMiB": 8}),
    ((4, 8), {"decodePoolMiB": 8, "prefillBufferMiB": 8}),  # ranks disagree: the config's
])
def test_the_staging_in_force_is_what_the_ranks_hold_not_a_later_config(
        held_mib: tuple[int, int], reported: dict[str, int]) -> None:
    """The ranks read the transfer config when vLLM registered the KV caches, the pod agent
    later: a size change that reached the pod in between must not be created and reported
    as in force while the ranks hold the old size (the config here says 8 MiB)."""
    base = free_ports(2)
    api = FakeAgentAPI()
    with canned_ranks(base, [0, 1], staging_mib=lambda r: held_mib[r]):
        agent = PodAgent(options(base), scheduler_live=lambda: 0).start(
            environ=POD_ENV, client_factory=lambda: api)
        try:
            wait(lambda: api.status_writes)
            assert api.objects[("ns", "demo-decode-0")]["spec"]["staging"] == reported
            assert api.status_writes[0]["staging"] == reported
        finally:
            agent.stop()


def wait(condition: Callable[[], object], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_a_resize_fails_with_the_first_ranks_error() -> None:
    base = free_ports(3)

    def reply(rank: int) -> StagingReply:
        return StagingReply(error=f"rank {rank} could not register") if rank else \
            StagingReply(registration_version=7, side="ring")

    with canned_ranks(base, [0, 1, 2], staging=reply):
        agent = PodAgent(options(base, tp=3), scheduler_live=lambda: 0)
        future = agent.resize_staging(AgentStaging(decode_pool_mib=1, prefill_buffer_mib=1))
        with pytest.raises(ControlError, match=r"^rank 1 could not register$"):
            future.result(20)
    with canned_ranks(base, [0, 1, 2], staging=lambda r: StagingReply(
            registration_version=3 + r, side="ring")):
        assert PodAgent(options(base, tp=3), scheduler_live=lambda: 0).resize_staging(
            AgentStaging(decode_pool_mib=1, prefill_buffer_mib=1)).result(20) == 5


def test_a_resize_with_an_unreachable_rank_fails_naming_it() -> None:
    base = free_ports(2)
    with canned_ranks(base, [0], staging=lambda r: StagingReply(side="ring")):
        future = PodAgent(options(base), scheduler_live=lambda: 0).resize_staging(
            AgentStaging(decode_pool_mib=1, prefill_buffer_mib=1))
        with pytest.raises(ControlError, match=f"cannot reach http://127.0.0.1:{base + 1}"):
            future.result(20)


def test_fetch_report_refuses_a_server_of_another_rank() -> None:
    base = free_ports(2)
    with canned_ranks(base, [0]):
        report = fetch_report(f"127.0.0.1:{base}", 0, TEST_AUTH, 2.0)
        assert report.live_requests == 4
        with pytest.raises(ControlError, match="MAC matches none"):
            fetch_report(f"127.0.0.1:{base}", 1, TEST_AUTH, 2.0)



@pytest.mark.parametrize(("bind_host", "expected"), [
    ("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"), ("10.1.2.3", "10.1.2.3")])
def test_ranks_are_read_where_they_listen(bind_host: str, expected: str) -> None:
    """Guards against an agent knocking on 127.0.0.1 while its ranks listen on the pod's own
    address only (seen: every status said the ranks were unreachable)."""
    assert rank_host(bind_host) == expected


# vLLM's own requests (engineRequests) -----------------------------------------------------------

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
"""


@contextmanager
def vllm_api_server(pages: dict[str, tuple[int, str]]) -> Iterator[int]:
    """A stand-in for vLLM's API server on a free port: GET answers ``pages[path]``
    (status, text), read at each request (a test changes them as it goes)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            code, text = pages.get(self.path, (404, "not found"))
            body = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def engine_options(base: int, engine_port: int | None) -> PodAgentOptions:
    return PodAgentOptions(role="decode", tp_size=2, config=CONFIG, auth=TEST_AUTH,
                           bootstrap_port=base, metrics_port=0, metrics_host="127.0.0.1",
                           engine_port=engine_port, fetch_timeout_s=1.0)


def test_the_pod_agent_reads_vllms_requests_from_its_api_servers_metrics() -> None:
    """Guards a decode's generations counted as none (the transfer module's own live
    requests are only KV in transfer): vLLM's running + waiting gauges, GET from its API
    server's /metrics (its gauges live in that process, not the scheduler's), None whenever
    vLLM does not answer with them."""
    pages = {"/metrics": (200, VLLM_METRICS.format(running=3.0, waiting=2.0))}
    with vllm_api_server(pages) as port:
        agent = PodAgent(engine_options(free_ports(2), port), scheduler_live=lambda: 0)
        assert agent.options.engine_metrics_url == f"http://127.0.0.1:{port}/metrics"
        assert agent.read_engine_requests() == 3 + 2
        pages["/metrics"] = (200, VLLM_METRICS.format(running=0.0, waiting=0.0))
        assert agent.read_engine_requests() == 0
        pages["/metrics"] = (500, "starting")
        assert agent.read_engine_requests() is None
        pages["/metrics"] = (200, "vllm:num_requests_running{ this is not exposition text")
        assert agent.read_engine_requests() is None
        pages["/metrics"] = (200, VLLM_METRICS.format(running=1.0, waiting=0.0)
                             .replace("vllm:num_requests_waiting", "vllm:other"))
        assert agent.read_engine_requests() is None  # running alone is no count
    assert agent.read_engine_requests() is None  # nothing listens any more
    no_port = PodAgent(engine_options(free_ports(2), None), scheduler_live=lambda: 0)
    assert (no_port.options.engine_metrics_url, no_port.read_engine_requests()) == (None, None)


def test_the_pod_agents_reports_carry_vllms_requests() -> None:
    """The pod agent's reporter writes what vLLM's /metrics said (one reading per write);
    once vLLM stops answering, engineRequests is absent and listed unknown."""
    base, api = free_ports(2), FakeAgentAPI()
    pages = {"/metrics": (200, VLLM_METRICS.format(running=4.0, waiting=1.0))}
    with vllm_api_server(pages) as port, canned_ranks(base, [0, 1]):
        agent = PodAgent(engine_options(base, port), scheduler_live=lambda: 0).start(
            environ=POD_ENV, client_factory=lambda: api)
        try:
            wait(lambda: api.status_writes)
            first = api.status_writes[0]
            assert first["engineRequests"] == 4 + 1
            assert "engineRequests" not in first.get("unknown", [])
            assert first["endpoints"]["engine"] == f"10.0.0.7:{port}"
            pages["/metrics"] = (503, "gone")
            assert agent.reporter is not None
            agent.reporter.tuning = replace(agent.reporter.tuning, report_interval_s=0.2)
            wait(lambda: "engineRequests" not in api.status_writes[-1])
            assert api.status_writes[-1]["unknown"] == ["engineRequests"]
        finally:
            agent.stop()
