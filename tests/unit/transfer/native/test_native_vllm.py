"""The engine-native agent's vLLM 0.32.0 NixlConnector mapping, against real `/metrics` text.

The captures in `tests/unit/data/vllm_0.32.0_nixl_*.prom` come from real vLLM CPU servers
(`python -m pd_testbed.captures.vllm_nixl_metrics`; each file's header says how). Expected
statuses are worked out by hand from the samples quoted next to each assert. No engine, no
network, no NIXL: the agent reads the files through a fake fetch and writes to an in-memory
API server (`pd_testbed.native_harness`).
"""

from __future__ import annotations

import pytest

from pd_contract.transferagent import (
    AgentEndpoints,
    QueueDepth,
    TransferAgentStatus,
    TransferFailure,
    TransferTime,
    WindowCounts,
)
from pd_testbed.native_harness import NOW, Run, capture
from pd_transfer.native.vllm_nixl import VLLM_0_32_0

pytestmark = pytest.mark.timeout(10)

P = "vllm_0.32.0_nixl_"
# process_start_time_seconds 1.79596415918e+09 in the healthy decode's captures (its prefill
# started 10 ms before it), 1.79596421132e+09 in the mismatched decode's.
PAIR_INCARNATION = "uid-1-1795964159180"
PREFILL_INCARNATION = "uid-1-1795964159170"
MISMATCH_INCARNATION = "uid-1-1795964211320"
ENDPOINTS = AgentEndpoints(engine="10.0.0.7:8000", metrics="10.0.0.7:9400")
NO_FETCH = [QueueDepth(name="kvFetchWaitingToStart"), QueueDepth(name="kvFetchInProgress"),
            QueueDepth(name="kvFetchCompletedWaiting")]
FAILED_TRANSFERS = ("vllm:nixl_num_failed_transfers_total +5 since the previous reading: "
                    "failed NIXL transfers, handshakes and notifications")


def decode(**changes: object) -> TransferAgentStatus:
    """A decode report with nothing measured yet; `changes` are what a test expects. Every
    capture's vLLM was idle when read: vllm:num_requests_running and _waiting 0."""
    base = TransferAgentStatus(
        pod_uid="uid-1", endpoints=ENDPOINTS, incarnation=PAIR_INCARNATION, engine_requests=0,
        window=WindowCounts(seconds=60, transfer_time=TransferTime(), requests=0,
                            request_errors=0), healthy=True,
        report_time=NOW, observed_generation=1, queues=NO_FETCH,
        unknown=["agents", "peers", "pendingKV", "ring", "transports"])
    return base.model_copy(update=changes)


PREFILL_UNKNOWN = ["agents", "bytesTotal", "liveRequests", "peers", "pendingKV", "queues",
                   "ring", "transfersTotal", "transports", "window.transferTime",
                   "window.transfers"]


def prefill(**changes: object) -> TransferAgentStatus:
    base = TransferAgentStatus(
        pod_uid="uid-1", endpoints=ENDPOINTS, incarnation=PREFILL_INCARNATION, engine_requests=0,
        window=WindowCounts(seconds=60, requests=0, request_errors=0), healthy=True,
        report_time=NOW, observed_generation=1, unknown=PREFILL_UNKNOWN)
    return base.model_copy(update=changes)


def test_healthy_decode_reports_transfers_bytes_and_transfer_time() -> None:
    """Guards the decode mapping (the side of NixlConnector that READs): transfers and bytes
    from the transfer histograms, time quantiles from the buckets, queues from kv_fetch."""
    run = Run(VLLM_0_32_0, "decode")
    run.read(P + "decode_fresh.prom", 0).read(P + "decode_warm.prom", 5)
    status = run.read(P + "decode_healthy.prom", 10).report(10)
    # healthy: vllm:nixl_xfer_time_seconds_count 5 (1 warm-up + 4), _bytes_transferred_sum
    # 458752 (65536 + 4 × 98304), failures 0; vllm:request_success_total 5 (all
    # finished_reason "length"), 0 "error". The engine started after the agent, so all of it
    # is in the 60 s window. Buckets: 2 in (0.005, 0.01], 2 in (0.01, 0.025], 1 in (0.1, 0.2]:
    #   p50: rank 2.5 of 5 → (0.01, 0.025], 0.01 + 0.015 × 0.5/2 = 0.01375
    #   p90: rank 4.5 → (0.1, 0.2], 0.1 + 0.1 × 0.5/1 = 0.15; p99: 0.1 + 0.1 × 0.95 = 0.195
    assert status == decode(
        bytes_total=458752, transfers_total=5,
        window=WindowCounts(seconds=60, transfers=5, requests=5, request_errors=0,
                            transfer_time=TransferTime(count=5, p50_seconds=0.01375,
                                                       p90_seconds=0.15, p99_seconds=0.195)))


def test_a_decode_agent_started_after_its_engine_counts_only_what_it_saw() -> None:
    """Guards against an agent restart reporting the engine's whole history as the window."""
    run = Run(VLLM_0_32_0, "decode")
    run.agent.tracker.agent_start_unix_s = 1.8e9  # after the engine's start (1.7960e9)
    run.read(P + "decode_warm.prom", 0)
    status = run.read(P + "decode_healthy.prom", 10).report(10)
    # Totals are the engine's (since its start): 5 transfers, 458752 bytes. The window is
    # what the agent saw: 5 - 1 = 4 transfers and requests (the warm-up's transfer was in
    # (0.1, 0.2]), 2 in (0.005, 0.01] and 2 in (0.01, 0.025]:
    #   p50: rank 2 → (0.005, 0.01], 0.005 + 0.005 × 2/2 = 0.01
    #   p90: rank 3.6 → (0.01, 0.025], 0.01 + 0.015 × 1.6/2 = 0.022; p99: 0.01 + 0.015 ×
    #   1.96/2 = 0.0247
    assert status == decode(
        bytes_total=458752, transfers_total=5,
        window=WindowCounts(seconds=60, transfers=4, requests=4, request_errors=0,
                            transfer_time=TransferTime(count=4, p50_seconds=0.01,
                                                       p90_seconds=0.022, p99_seconds=0.0247)))


def test_decode_with_other_kv_heads_than_its_prefill_is_unhealthy_with_the_reason() -> None:
    """Guards against a fleet that looks Ready and serves nothing: every request fails with
    HTTP 500 ('compatibility hash mismatch') while /health stays 200;
    vllm:nixl_num_failed_transfers_total grows (5 after 3 requests: a failed handshake is
    counted per handshake attempt) and vLLM counts the 3 requests as finished_reason
    "error", the request errors an engine rollout judges."""
    status = Run(VLLM_0_32_0, "decode").read(P + "decode_kv_heads_mismatch.prom", 0).report(0)
    failure = TransferFailure(pod="demo-decode-0", reason="TransferFailed",
                              message=FAILED_TRANSFERS, time=NOW)
    # 5 failed of 5 (no READ completed): ratio 1 > 0.05; 3 requests, 3 errors.
    assert status == decode(
        incarnation=MISMATCH_INCARNATION, transfers_total=5, failures_total=5,
        failures_by_reason={"TransferFailed": 5},
        window=WindowCounts(seconds=60, transfers=5, failures=5,
                            failures_by_reason={"TransferFailed": 5},
                            transfer_time=TransferTime(), requests=3, request_errors=3),
        recent_failures=[failure], healthy=False, last_error=FAILED_TRANSFERS)


def test_failing_decode_is_written_at_once_not_at_the_next_interval() -> None:
    """Guards 'within one report window': a health flip is written at the reporter's next
    tick (>= 1 s after the previous write), not after the 5 s report interval."""
    run = Run(VLLM_0_32_0, "decode")
    healthy = run.read(P + "decode_healthy.prom", 0).report(0)
    assert healthy is not None and healthy.healthy is True
    assert run.report(1) is None  # nothing changed: the interval is 5 s
    # The engine restarted as the mismatched decode (another process start time).
    failing = run.read(P + "decode_kv_heads_mismatch.prom", 2).report(2)
    assert failing is not None
    # Totals: the new incarnation's own (5 failed); the window: both incarnations, 5 + 5
    # transfers, and 5 + 3 requests of which the 3 errors.
    assert (failing.healthy, failing.incarnation, failing.transfers_total,
            failing.failures_total) == (False, MISMATCH_INCARNATION, 5, 5)
    assert (failing.window.transfers, failing.window.failures) == (10, 5)
    assert (failing.window.requests, failing.window.request_errors) == (8, 3)


def test_prefill_reports_expired_leases_as_its_peers_failures_and_unknown_transfers() -> None:
    """Guards unknown-vs-zero on the side that does not READ: a NixlConnector prefill exports
    the transfer histograms but never fills them, so its transfers, bytes and transfer times
    are listed unknown (not 0 measured), and its expired KV leases (the decode never read)
    are recent failures of a peer, not failures of this pod (which would make the router
    drop a healthy prefill for a broken decode)."""
    run = Run(VLLM_0_32_0, "prefill")
    # This capture's decode read nothing after a lease expired; an earlier one's did once,
    # on a loaded machine: the warm and later captures with that counter at 1 stand in.
    late = 'vllm:nixl_num_notifications_after_expiry_total{engine="0",model_name="tiny-llama"}'

    def read_late(name: str, at_s: float) -> None:
        text = capture(P + name)
        assert f"{late} 0.0" in text
        run.read_text(text.replace(f"{late} 0.0", f"{late} 1.0"), at_s)

    run.read(P + "prefill_fresh.prom", 0)
    read_late("prefill_warm.prom", 5)
    read_late("prefill_leases_expired.prom", 100)
    status = run.report(100)
    # warm: kv_expired_reqs 0, notifications_after_expiry 1 (edited); leases_expired: 3 and
    # 1 (edited).
    expired_3 = TransferFailure(
        pod="demo-prefill-0", reason="LeaseExpired", time=NOW,
        message="vllm:nixl_num_kv_expired_reqs_total +3 since the previous reading: requests "
                "whose KV no decode read before its lease expired; a failure of a peer's "
                "transfer, not counted as this pod's")
    late_1 = TransferFailure(
        pod="demo-prefill-0", reason="ReadAfterExpiry", time=NOW,
        message="vllm:nixl_num_notifications_after_expiry_total +1 since the previous "
                "reading: reads of KV blocks after their lease expired (blocks may have been "
                "reused); a failure of a peer's transfer, not counted as this pod's")
    # vllm:request_success_total 17 ended (the P/D prefills and the 1-token ticks the P/D
    # client sends while decode reads), no error: all news (the engine started after the
    # agent), one report.
    assert status == prefill(recent_failures=[expired_3, late_1], last_error=expired_3.message,
                             window=WindowCounts(seconds=60, requests=17, request_errors=0))


def test_the_same_zero_is_measured_on_decode_and_unknown_on_prefill() -> None:
    """Guards against reporting 'not exported' as 0: both fresh servers export
    vllm:nixl_bytes_transferred_sum 0.0, but only the decode's means 'no bytes'."""
    on_decode = Run(VLLM_0_32_0, "decode").read(P + "decode_fresh.prom", 0).report(0)
    on_prefill = Run(VLLM_0_32_0, "prefill").read(P + "prefill_fresh.prom", 0).report(0)
    assert on_decode is not None and on_prefill is not None
    assert (on_decode.bytes_total, "bytesTotal" in on_decode.unknown) == (0, False)
    assert (on_prefill.bytes_total, "bytesTotal" in on_prefill.unknown) == (0, True)
    assert on_decode.window.transfer_time == TransferTime()  # measured: none in the window
    assert on_prefill.window.transfer_time is None  # not measured


def _without(text: str, family: str) -> str:
    return "\n".join(line for line in text.splitlines() if family not in line) + "\n"


def test_a_vanished_metric_is_an_agent_error_not_health_and_clears_when_back() -> None:
    """Guards against a renamed or dropped metric reading as 'no failures': the status says
    which metric is missing, healthy false, and keeps the last numbers."""
    run = Run(VLLM_0_32_0, "decode")
    run.read(P + "decode_healthy.prom", 0).report(0)
    text = _without(capture(P + "decode_healthy.prom"), "vllm:nixl_bytes_transferred")
    status = run.read_text(text, 2).report(2)
    assert status is not None
    assert status.last_error == (
        "agent error: vllm 0.32.0 (NixlConnector) metrics of a decode: "
        "vllm:nixl_bytes_transferred (histogram: bytes per NIXL KV cache transfer) is "
        "missing. This agent maps vllm 0.32.0; another engine version, connector or role "
        "exports other metrics (vLLM serves its metrics on its API port at /metrics; the "
        "vllm:nixl_* metrics exist only with --kv-transfer-config naming NixlConnector)")
    assert (status.healthy, status.bytes_total, status.transfers_total) == (False, 458752, 5)
    back = run.read(P + "decode_healthy.prom", 4).report(4)
    assert back is not None and (back.healthy, back.last_error) == (True, "")


def test_an_engine_version_with_other_names_is_reported_as_such() -> None:
    """Guards a vLLM upgrade that renames the NIXL metrics: every mapped one is named."""
    text = capture(P + "decode_healthy.prom").replace("vllm:nixl_", "vllm:nixl_v2_")
    status = Run(VLLM_0_32_0, "decode").read_text(text, 0).report(0)
    assert status is not None and status.healthy is False
    for family in ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred",
                   "vllm:nixl_num_failed_transfers_total",
                   "vllm:nixl_num_failed_notifications_total",
                   "vllm:nixl_num_kv_expired_reqs_total"):
        assert f"{family} (" in status.last_error


UNREADABLE = ("agent error: cannot read the engine's metrics: GET "
              "http://127.0.0.1:8000/metrics failed: ConnectionRefusedError")


def test_an_engine_never_read_is_unhealthy_with_the_reason() -> None:
    status = Run(VLLM_0_32_0, "decode").unreachable(0).report(0)
    assert status is not None and (status.healthy, status.last_error) == (False, UNREADABLE)


def test_one_missed_reading_is_tolerated_two_in_a_row_are_not() -> None:
    """Guards a busy engine whose /metrics misses one scrape's timeout from taking its pod
    out of service, without hiding an engine that stays unreadable."""
    run = Run(VLLM_0_32_0, "decode")
    run.read(P + "decode_healthy.prom", 0).report(0)
    tolerated = run.unreachable(5).report(5)
    assert tolerated is not None and (tolerated.healthy, tolerated.last_error) == (True, "")
    failing = run.unreachable(10).report(10)
    assert failing is not None and (failing.healthy, failing.last_error) == (False, UNREADABLE)
    assert (failing.transfers_total, failing.bytes_total) == (5, 458752)  # the last numbers


def test_a_busy_engine_is_given_the_grace_an_unreadable_one_is_not() -> None:
    """Guards a P/D engine on a loaded host (vLLM's NixlConnector decode spinning beside its
    prefill: /metrics missed several 10 s timeouts in a row) from being taken out of the
    router by its own sidecar: timeouts count only after 60 s without a reading."""
    run = Run(VLLM_0_32_0, "decode")
    run.read(P + "decode_healthy.prom", 0).report(0)
    for at_s in (5, 20, 35, 50, 60):
        busy = run.busy(at_s).report(at_s)
        assert busy is None or (busy.healthy, busy.last_error) == (True, ""), at_s
    late = run.busy(61).report(70)
    assert late is not None and (late.healthy, late.last_error) == (False, (
        "agent error: the engine's metrics have not been read for 61 s: GET "
        "http://127.0.0.1:8000/metrics failed: TimeoutError: timed out"))
    back = run.read(P + "decode_healthy.prom", 75).report(80)
    assert back is not None and (back.healthy, back.last_error) == (True, "")


def test_other_engines_text_is_not_read_as_vllm() -> None:
    status = Run(VLLM_0_32_0, "decode").read("sglang_0.5.23_decode_healthy.prom", 0).report(0)
    assert status is not None and status.healthy is False
    assert status.last_error.startswith(
        "agent error: no vllm:* metric is exported at all: vLLM serves its metrics")


RUNNING = 'vllm:num_requests_running{engine="0",model_name="tiny-llama"}'
WAITING = 'vllm:num_requests_waiting{engine="0",model_name="tiny-llama"}'
WAITING_CAPACITY = ('vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",'
                    'reason="capacity"}')


def test_the_engines_requests_are_its_running_and_waiting_requests_over_every_engine() -> None:
    """Guards the scale-down choice (the operator removes the pods holding the fewest
    requests first) against a decode's generations counted as none: engineRequests is vLLM's
    running + waiting gauges summed over every label set (a DP engine "1" too), from the
    same reading as the transfers; the by-reason split of the waiting ones is not added
    again."""
    text = capture(P + "decode_healthy.prom")
    for sample in (RUNNING, WAITING, WAITING_CAPACITY):
        assert f"{sample} 0.0" in text
    text = (text.replace(f"{RUNNING} 0.0",
                         f"{RUNNING} 3.0\n" + RUNNING.replace('"0"', '"1"') + " 1.0")
            .replace(f"{WAITING} 0.0", f"{WAITING} 2.0")
            .replace(f"{WAITING_CAPACITY} 0.0", f"{WAITING_CAPACITY} 2.0"))
    status = Run(VLLM_0_32_0, "decode").read_text(text, 0).report(0)
    assert status is not None and status.healthy is True
    assert (status.engine_requests, "engineRequests" in status.unknown) == (3 + 1 + 2, False)
    assert status.to_wire()["engineRequests"] == 6


def test_the_engines_requests_are_unknown_after_a_failed_reading_never_zero() -> None:
    """Guards against a pod whose engine did not answer looking idle (and removed first):
    the reading that failed, though tolerated for health, leaves engineRequests absent and
    listed unknown; the next reading measures it again."""
    run = Run(VLLM_0_32_0, "decode")
    first = run.read(P + "decode_healthy.prom", 0).report(0)
    assert first is not None and first.engine_requests == 0
    missed = run.unreachable(5).report(5)
    assert missed is not None and missed.healthy is True  # one missed reading is tolerated
    assert (missed.engine_requests, "engineRequests" in missed.unknown) == (None, True)
    assert "engineRequests" not in missed.to_wire()
    assert missed.unknown == ["agents", "engineRequests", "peers", "pendingKV", "ring",
                              "transports"]
    back = run.read(P + "decode_healthy.prom", 10).report(10)
    assert back is not None
    assert (back.engine_requests, back.unknown) == (0, ["agents", "peers", "pendingKV", "ring",
                                                        "transports"])


def test_the_engines_requests_are_unknown_without_their_waiting_gauge() -> None:
    """A reading without vllm:num_requests_waiting (another vLLM, metrics cut down) counts
    no requests rather than only the running ones; the transfers are still read."""
    text = _without(capture(P + "decode_healthy.prom"), "vllm:num_requests_waiting")
    status = Run(VLLM_0_32_0, "decode").read_text(text, 0).report(0)
    assert status is not None and (status.healthy, status.transfers_total) == (True, 5)
    assert (status.engine_requests, "engineRequests" in status.unknown) == (None, True)
