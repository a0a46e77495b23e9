"""The engine-native agent's pure core and its reporting, apart from one engine's table:
histogram quantiles, counter resets (engine restarts), refused staging sizes, its own
metrics and its command line. No engine, no network beyond a local port, no NIXL."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from pd_testbed.agent_fakes import FakeAgentAPI
from pd_testbed.native_harness import (
    AGENT_START_UNIX_S,
    Run,
    capture,
    config,
    identity_env,
)
from pd_transfer.agent.identity import read_identity
from pd_transfer.native.agent import NativeAgent, NativeOptions
from pd_transfer.native.errors import ScrapeError, ScrapeTimeout
from pd_transfer.native.exposition import Histogram
from pd_transfer.native.scrape import fetch_metrics
from pd_transfer.native.vllm_nixl import VLLM_0_32_0

pytestmark = pytest.mark.timeout(30)

P = "vllm_0.32.0_nixl_"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def hist(*counts: tuple[float, float]) -> Histogram:
    return Histogram(tuple(counts), counts[-1][1], 0.0)


def test_quantiles_interpolate_within_a_bucket_like_promql() -> None:
    """Guards the estimate the status reports: linear in the bucket the rank falls in."""
    h = hist((0.1, 2.0), (1.0, 6.0), (math.inf, 8.0))
    # rank 4 of 8 → (0.1, 1.0], 0.1 + 0.9 × (4 - 2)/(6 - 2) = 0.55
    assert h.quantile(0.5) == pytest.approx(0.55)
    # rank 7.92 → the open +Inf bucket: its lower bound, 1.0 (nothing larger can be said)
    assert h.quantile(0.99) == 1.0
    assert Histogram.empty().quantile(0.5) is None


def test_histogram_differences_never_go_negative() -> None:
    later, earlier = hist((1.0, 2.0), (math.inf, 3.0)), hist((1.0, 5.0), (math.inf, 5.0))
    assert later.minus(earlier) == Histogram(((1.0, 0.0), (math.inf, 0.0)), 0.0, 0.0)


def _restarted(text: str, start: str) -> str:
    return text.replace("process_start_time_seconds 1.79596415918e+09",
                        f"process_start_time_seconds {start}")


def test_a_restarted_vllm_starts_a_new_incarnation_by_its_start_time() -> None:
    """Guards counter resets: a restart with no counter below the last reading (the new
    process has already done more) is still a restart: vLLM's process start time moved."""
    run = Run(VLLM_0_32_0, "decode")
    run.read(P + "decode_healthy.prom", 0).report(0)
    status = run.read_text(_restarted(capture(P + "decode_healthy.prom"), "1.7959642e+09"),
                           3).report(5)
    assert status is not None
    # The new process's own 5 transfers; the window holds both incarnations' 5 + 5.
    assert (status.incarnation, status.transfers_total, status.window.transfers) == (
        "uid-1-1795964200000", 5, 10)


def test_counters_that_go_down_mean_a_restart_and_the_window_never_shrinks() -> None:
    """Guards deltas going negative when an engine restarts between two readings."""
    run = Run(VLLM_0_32_0, "decode")
    run.read(P + "decode_healthy.prom", 0)  # 5 transfers
    run.read(P + "decode_fresh.prom", 5)  # same start time, counters back to 0
    status = run.read(P + "decode_warm.prom", 10).report(10)  # 1 transfer
    assert status is not None
    assert (status.transfers_total, status.bytes_total) == (1, 65536)
    assert status.window.transfers == 6
    assert status.window.transfer_time is not None and status.window.transfer_time.count == 6
    assert run.agent.tracker.incarnations == 2


# Each capture's own counters, read off the file: (transfers, failures, bytes, failures by
# reason), where transfers = vllm:nixl_xfer_time_seconds_count (the READs that succeeded) +
# vllm:nixl_num_failed_transfers_total (TransferFailed), bytes =
# vllm:nixl_bytes_transferred_sum; every other failure counter is 0 in all four.
OWN_COUNTS: dict[str, tuple[int, int, int, dict[str, int]]] = {
    P + "decode_fresh.prom": (0, 0, 0, {}),
    P + "decode_warm.prom": (1, 0, 65536, {}),
    P + "decode_healthy.prom": (5, 0, 458752, {}),
    P + "decode_kv_heads_mismatch.prom": (5, 5, 0, {"TransferFailed": 5}),  # 0 READs + 5 failed
}
NAMES = list(OWN_COUNTS)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(NAMES), min_size=1, max_size=12))
def test_window_counts_only_grow_and_totals_are_the_last_readings_own(names: list[str]) -> None:
    """Invariant: the counts the reporter's window is computed from never decrease, for any
    order of readings (restarts included); and the totals are the last reading's own (the
    current incarnation's, whatever came before: guards a restart's deltas leaking into
    them)."""
    run = Run(VLLM_0_32_0, "decode")
    previous = (0, 0, 0)
    for at, name in enumerate(names):
        run.read(name, float(at))
        snap = run.agent.snapshots()[0]
        now = (snap.succeeded, snap.failed, snap.bytes_transferred)
        assert all(a <= b for a, b in zip(previous, now, strict=True)), (names, previous, now)
        previous = now
    status = run.report(float(len(names)))
    assert status is not None
    assert (status.transfers_total, status.failures_total, status.bytes_total,
            status.failures_by_reason) == OWN_COUNTS[names[-1]], names


def test_a_spec_asking_for_staging_sizes_is_refused_and_never_reported_in_force() -> None:
    """Guards against a STAGING column showing a size no pod confirmed: this agent has no
    staging pool, so it says so in lastError, reports no staging in force and does not move
    observedGeneration to the spec it cannot apply."""
    run = Run(VLLM_0_32_0, "decode")
    first = run.read(P + "decode_healthy.prom", 0).report(0)
    assert first is not None and (first.staging, first.observed_generation) == (None, 1)
    run.api.set_spec_staging("ns", "demo-decode-0",
                             {"decodePoolMiB": 512, "prefillBufferMiB": 64})
    obj = run.api.get("ns", "demo-decode-0")
    assert obj is not None
    run.agent.on_object(obj)  # what the spec watch delivers
    assert run.report(5) is None  # the spec change moved resourceVersion: 409, re-read
    status = run.report(6)
    assert status is not None
    assert status.last_error == (
        "staging resize refused: spec.staging asks for decodePoolMiB=512, "
        "prefillBufferMiB=64 (generation 2), but this pod's engine, vllm 0.32.0 "
        "(NixlConnector), moves KV with its own connector, which has no staging pool: "
        "nothing was resized (spec.transfer.backend EngineNative takes no staging sizes)")
    assert (status.staging, status.resizing, status.observed_generation,
            status.healthy) == (None, False, 1, True)


def test_the_transferagent_it_creates_is_owned_by_its_pod() -> None:
    run = Run(VLLM_0_32_0, "prefill")
    run.read(P + "prefill_fresh.prom", 0).report(0)
    obj = run.api.objects[("ns", "demo-prefill-0")]
    assert obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "demo-prefill-0", "uid": "uid-1"}]
    assert obj["metadata"]["labels"] == {"pd.serving.dev/deployment": "demo",
                                         "pd.serving.dev/role": "prefill",
                                         "app.kubernetes.io/managed-by": "pd-transfer-agent"}


def test_its_own_metrics_count_readings_restarts_and_what_it_saw() -> None:
    port = free_port()
    texts = [capture(P + "decode_fresh.prom"), capture(P + "decode_kv_heads_mismatch.prom")]
    identity = read_identity(identity_env("decode"), started_unix_s=AGENT_START_UNIX_S)
    options = NativeOptions(mapping=VLLM_0_32_0, metrics_url="http://127.0.0.1:1/metrics",
                            scrape_s=3600.0, metrics_port=port, metrics_host="127.0.0.1")
    agent = NativeAgent(options, identity, config(), fetch=lambda url, timeout: texts.pop(0),
                        wall=lambda: datetime(2026, 1, 1, tzinfo=UTC))
    agent.start(FakeAgentAPI())
    try:
        agent.read_once()  # the second capture: another engine start → a restart
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    finally:
        agent.stop()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}

    def sample(name: str, **labels: str) -> float:
        key = tuple(sorted({"engine": "vllm", "version": "0.32.0", **labels}.items()))
        return samples[(name, key)]

    assert sample("pd_transfer_native_engine_readings_total", result="ok") == 2.0
    assert sample("pd_transfer_native_engine_incarnations_total") == 2.0
    assert sample("pd_transfer_native_transfer_failures_total", reason="TransferFailed") == 5.0
    assert sample("pd_transfer_native_queue_requests", queue="kvFetchInProgress") == 0.0


def test_the_command_refuses_a_pod_spec_without_identity(tmp_path: Path) -> None:
    """Guards a hand-written sidecar: it exits 2 at once, naming each missing variable."""
    config_file = tmp_path / "transfer.json"
    config_file.write_text(config().model_dump_json())
    proc = subprocess.run(
        [sys.executable, "-m", "pd_transfer.cli", "agent", "--engine", "vllm",
         "--engine-metrics-url", "http://127.0.0.1:8000/metrics", "--config", str(config_file)],
        capture_output=True, text=True, timeout=60, check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert proc.returncode == 2
    for variable in ("POD_NAME", "POD_NAMESPACE", "POD_UID", "POD_IP", "PD_DEPLOYMENT",
                     "PD_ROLE"):
        assert f"{variable} is not set" in proc.stderr


def test_an_unmapped_engine_version_is_refused_at_start() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pd_transfer.cli", "agent", "--engine", "vllm",
         "--engine-version", "0.99.0", "--engine-metrics-url", "http://127.0.0.1:8000/metrics",
         "--config", "/nonexistent"],
        capture_output=True, text=True, timeout=60, check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert proc.returncode == 2
    assert "no metric mapping for vllm 0.99.0; mapped versions: 0.32.0" in proc.stderr


def test_a_silent_engine_is_a_timeout_a_closed_port_is_not() -> None:
    """The two failures the agent tells apart, over real sockets: a listener that takes the
    connection and never answers (a busy engine) and a port nobody listens on."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/metrics"
        with pytest.raises(ScrapeTimeout, match=f"GET {url} failed: .*timed out"):
            fetch_metrics(url, 0.2)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/metrics"
    with pytest.raises(ScrapeError, match="Connection refused") as refused:
        fetch_metrics(url, 0.2)
    assert not isinstance(refused.value, ScrapeTimeout)
