"""The engine-native agent's SGLang 0.5.23 mapping, against exposition text made by SGLang's
own metrics collector.

SGLang cannot run on these machines: PyPI `sglang` has no CPU build (its kernels are CUDA
only) and there is no GPU here. So `tests/unit/data/sglang_0.5.23_*.prom` were produced by
SGLang 0.5.23's own `SchedulerMetricsCollector`, fed the calls its disaggregation code makes
and exposed the way its HTTP server does (prometheus_client multiprocess mode):
`devtools/pd_testbed/captures/sglang_metrics.py` says how. Expected statuses are worked out by hand.
No engine, no network, no NIXL.
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
from pd_transfer.native.sglang import SGLANG_0_5_23

pytestmark = pytest.mark.timeout(10)

P = "sglang_0.5.23_"
ENDPOINTS = AgentEndpoints(engine="10.0.0.7:8000", metrics="10.0.0.7:9400")
MIB = 1024 * 1024


# SGLang 0.5.23 exports no per-outcome request count the agent maps: request errors are
# unknown (an engine rollout judges SGLang pods by transfers, restarts and readiness). The
# captures keep only the mapping's families and those logged with them: without
# sglang:num_queue_reqs the engine's requests are unknown too (never its running ones alone).
PREFILL_UNKNOWN = ["agents", "engineRequests", "peers", "pendingKV", "ring", "transports",
                   "window.requestErrors", "window.requests"]

def status(**fields: object) -> TransferAgentStatus:
    """A report as the agent writes it at `NOW` (SGLang exports no start time: the
    incarnation is the pod UID and the wall time of the agent's first reading, `NOW`)."""
    base = TransferAgentStatus(pod_uid="uid-1", endpoints=ENDPOINTS,
                               incarnation=f"uid-1-{round(NOW.timestamp() * 1000)}",
                               healthy=True, report_time=NOW, observed_generation=1)
    return base.model_copy(update=fields)


def failures(pod: str, *, transfer: int, bootstrap: int) -> tuple[TransferFailure, ...]:
    """The failures one reading reports when both of SGLang's failure counters grew by
    `transfer` and `bootstrap`: transfer failures first."""
    return (
        TransferFailure(pod=pod, reason="TransferFailed", time=NOW,
                        message=f"sglang:num_transfer_failed_reqs_total +{transfer} since the "
                                "previous reading: requests failed in their KV transfer"),
        TransferFailure(pod=pod, reason="BootstrapFailed", time=NOW,
                        message=f"sglang:num_bootstrap_failed_reqs_total +{bootstrap} since "
                                "the previous reading: requests failed to bootstrap with "
                                "their peer"))


PREFILL_QUEUES = [QueueDepth(name="prefillBootstrap", depth=2, high_water=2),
                  QueueDepth(name="prefillInflight", depth=1, high_water=1)]
# Latencies 8, 12, 30, 45, 120 ms → cumulative buckets (ms) ≤10: 1, ≤25: 2, ≤50: 4,
# ≤100: 4, ≤250: 5. p50: rank 2.5 → (25, 50], 25 + 25 × 0.5/2 = 31.25 ms; p90: rank 4.5 →
# (100, 250], 100 + 150 × 0.5/1 = 175 ms; p99: 100 + 150 × 0.95 = 242.5 ms.
PREFILL_TIMES = TransferTime(count=5, p50_seconds=0.03125, p90_seconds=0.175,
                             p99_seconds=0.2425)
# 1.5 + 1.5 + 3 + 3 + 6 MiB.
PREFILL_BYTES = 15 * MIB


def test_healthy_prefill_reports_what_it_sent() -> None:
    """Guards the prefill mapping (SGLang pushes: the prefill times and sizes transfers)."""
    run = Run(SGLANG_0_5_23, "prefill")
    result = run.read(P + "prefill_idle.prom", 0).read(P + "prefill_healthy.prom", 5).report(5)
    # per_stage_req_latency_seconds{stage="prefill_transfer_kv_cache"}_count 5; the inflight
    # queue (1) is the transfers in flight.
    assert result == status(
        bytes_total=PREFILL_BYTES, transfers_total=5, live_requests=1,
        window=WindowCounts(seconds=60, transfers=5, transfer_time=PREFILL_TIMES),
        queues=PREFILL_QUEUES, unknown=PREFILL_UNKNOWN)


def test_failing_prefill_counts_failures_by_reason_and_is_unhealthy() -> None:
    run = Run(SGLANG_0_5_23, "prefill")
    result = run.read(P + "prefill_idle.prom", 0).read(P + "prefill_failing.prom", 5).report(5)
    transfer, bootstrap = failures("demo-prefill-0", transfer=3, bootstrap=1)
    # 5 sent + 3 + 1 failed = 9 transfers, 4 failures: 4 > 0.05 × 9.
    reasons = {"BootstrapFailed": 1, "TransferFailed": 3}
    assert result == status(
        bytes_total=PREFILL_BYTES, transfers_total=9, failures_total=4,
        failures_by_reason=reasons, live_requests=1,
        window=WindowCounts(seconds=60, transfers=9, failures=4, failures_by_reason=reasons,
                            transfer_time=PREFILL_TIMES),
        recent_failures=[transfer, bootstrap], healthy=False, last_error=transfer.message,
        queues=PREFILL_QUEUES, unknown=PREFILL_UNKNOWN)


DECODE_QUEUES = [QueueDepth(name="decodePrealloc", depth=3, high_water=3),
                 QueueDepth(name="decodeTransfer", depth=2, high_water=2)]
DECODE_UNKNOWN = ["agents", "bytesTotal", "engineRequests", "peers", "pendingKV", "ring",
                  "transports", "window.requestErrors", "window.requests",
                  "window.transferTime"]


def test_decode_counts_arrivals_and_lists_bytes_and_times_unknown() -> None:
    """Guards unknown-vs-zero on SGLang's receiving side: it counts arrivals
    (stage="decode_transferred") but neither sizes nor times transfers."""
    run = Run(SGLANG_0_5_23, "decode")
    result = run.read(P + "decode_idle.prom", 0).read(P + "decode_failing.prom", 5).report(5)
    transfer, bootstrap = failures("demo-decode-0", transfer=2, bootstrap=4)
    reasons = {"BootstrapFailed": 4, "TransferFailed": 2}
    # 4 arrived + 6 failed = 10; the transfer queue (2) is in flight.
    assert result == status(
        transfers_total=10, failures_total=6, failures_by_reason=reasons, live_requests=2,
        window=WindowCounts(seconds=60, transfers=10, failures=6, failures_by_reason=reasons),
        recent_failures=[transfer, bootstrap], healthy=False, last_error=transfer.message,
        queues=DECODE_QUEUES, unknown=DECODE_UNKNOWN)


def test_families_that_appear_with_their_first_event_are_not_missing_before_it() -> None:
    """Guards SGLang's multiprocess metrics: before the first transfer, the transfer families
    do not exist at all; that is zero, not a mapping error."""
    result = Run(SGLANG_0_5_23, "decode").read(P + "decode_idle.prom", 0).report(0)
    assert result == status(
        window=WindowCounts(seconds=60),
        queues=[QueueDepth(name="decodePrealloc"), QueueDepth(name="decodeTransfer")],
        unknown=DECODE_UNKNOWN)


def _without(text: str, family: str) -> str:
    return "\n".join(line for line in text.splitlines() if family not in line) + "\n"


def test_a_counter_gone_without_a_restart_is_an_agent_error() -> None:
    """Guards a vanished metric: the failure counter disappears while the others stay (and
    do not go down), which no restart explains."""
    run = Run(SGLANG_0_5_23, "prefill")
    run.read(P + "prefill_failing.prom", 0).report(0)
    text = _without(capture(P + "prefill_failing.prom"), "sglang:num_transfer_failed_reqs")
    result = run.read_text(text, 2).report(2)
    assert result is not None and result.healthy is False
    assert result.last_error == (
        "agent error: sglang 0.5.23 (NIXL/Mooncake transfer backend): "
        "sglang:num_transfer_failed_reqs_total was exported by this engine and is gone "
        "although the engine did not restart; this agent maps sglang 0.5.23")


def test_a_renamed_queue_gauge_is_caught_by_the_gauge_logged_with_it() -> None:
    text = _without(capture(P + "prefill_idle.prom"), "sglang:num_prefill_inflight_queue_reqs")
    result = Run(SGLANG_0_5_23, "prefill").read_text(text, 0).report(0)
    assert result is not None and result.healthy is False
    assert ("sglang:num_prefill_inflight_queue_reqs (gauge: requests in the prefill inflight "
            "(sending) queue) is missing") in result.last_error


def test_an_sglang_restart_starts_a_new_incarnation_and_keeps_the_window() -> None:
    """Guards counter resets: a restarted SGLang's multiprocess metrics start empty; totals
    restart with a new incarnation while the window keeps what happened (never negative)."""
    run = Run(SGLANG_0_5_23, "prefill")
    run.read(P + "prefill_idle.prom", 0).read(P + "prefill_failing.prom", 5).report(5)
    run.agent.wall = lambda: NOW.replace(minute=1)  # the restart is read a minute later
    result = run.read(P + "prefill_idle.prom", 10).report(10)
    assert result is not None
    assert result.incarnation == f"uid-1-{round(NOW.replace(minute=1).timestamp() * 1000)}"
    assert (result.transfers_total, result.failures_total, result.bytes_total) == (0, 0, 0)
    assert (result.window.transfers, result.window.failures) == (9, 4)
    assert run.agent.tracker.incarnations == 2


PREFILL_LABELS = ('{engine_type="prefill",model_name="tiny-llama",moe_ep_rank="0",pp_rank="0",'
                  'tp_rank="0"}')
RANK_1_LABELS = PREFILL_LABELS.replace('tp_rank="0"', 'tp_rank="1"')


def test_the_engines_requests_are_its_running_and_queued_requests() -> None:
    """engineRequests on SGLang: sglang:num_running_reqs + sglang:num_queue_reqs (the
    gauge SGLang's scheduler writes with it, cut from the captures), over every rank's label
    set; its disaggregation queues stay in status.queues."""
    text = capture(P + "prefill_healthy.prom")
    running = f"sglang:num_running_reqs{PREFILL_LABELS}"
    assert f"{running} 0.0" in text
    text = text.replace(f"{running} 0.0", f"{running} 4.0") + (
        "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n"
        "# TYPE sglang:num_queue_reqs gauge\n"
        f"sglang:num_queue_reqs{PREFILL_LABELS} 2.0\n"
        f"sglang:num_queue_reqs{RANK_1_LABELS} 1.0\n")
    result = Run(SGLANG_0_5_23, "prefill").read_text(text, 0).report(0)
    assert result is not None and result.queues == PREFILL_QUEUES
    assert (result.engine_requests, "engineRequests" in result.unknown) == (4 + 2 + 1, False)
