"""`pd-transfer agent` as real sidecar processes next to real vLLM NixlConnector servers (CPU)
reporting into the real kube-apiserver the suite starts, with the engine pods' own
least-privilege identity (the operator's ServiceAccount, Role and RoleBinding).

One test, two phases (a vLLM start takes half a minute or more on 2 cores):
1. healthy: a NixlConnector prefill and decode of one tiny Llama, an agent beside each;
   after a few P/D requests the decode's TransferAgent reports transfers, bytes, transfer
   times and healthy; the prefill's reports what its engine cannot measure as unknown;
2. broken: the decode's engine restarts with other KV heads than its prefill (a new
   incarnation on the same port): every P/D request answers HTTP 500 while vLLM's /health
   stays 200; the decode's TransferAgent says healthy false with the failures by reason
   within one report window (typically one reading interval plus a reporter tick).
The agents then stop on SIGTERM with exit code 0.

Marked `long` (`make test-long`, about 130 s on 2 cores): CI runs the same sidecars through
the operator in `tests/e2e/test_vllm_cluster.py` (the EngineNative decode reports its
transfers and health; a decode with other KV heads turns TransferHealthy False naming it)
and their metric mapping on vLLM's captured metrics
(`tests/unit/transfer/native/test_native_vllm.py`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from pd_contract.transferagent import TransferAgentStatus
from pd_devcluster import ControlPlaneHandle, service_account_kubeconfig
from pd_operator.build import Capabilities
from pd_operator.build.names import agent_service_account
from pd_operator.kube import KubeClient
from pd_operator.reconcile import Reconciler
from pd_testbed.cluster import NAME, example_body
from pd_testbed.polling import wait_for
from pd_testbed.vllm import (
    ModelSpec,
    VllmServer,
    complete,
    free_ports,
    nixl_pd_complete,
    nixl_server_pair,
    pd_transfer_config,
    prompt_ids,
    scrape,
    scrape_sum,
    start_servers,
    vllm_env_or_skip,
)

pytestmark = [pytest.mark.e2e, pytest.mark.nixl, pytest.mark.long, pytest.mark.timeout(900)]

GROUP, VERSION = "pd.serving.dev", "v1alpha1"
MODEL = ModelSpec(layers=2, kv_heads=2, hidden=256, heads=4)
MISMATCHED = ModelSpec(layers=2, kv_heads=1, hidden=256, heads=4)
REPORT_INTERVAL_S = 2.0
WINDOW_S = 300.0  # longer than phase 1 takes on a loaded 2-core machine (once over 120 s)
# vLLM's KV lease on the prefill (`kv_lease_duration`): long enough that a slow first
# handshake on a loaded machine does not expire the warm-up request's blocks.
LEASE = {"kv_lease_duration": 90}


def reconcile_example(control_plane: ControlPlaneHandle, kube_client: k8s.ApiClient,
                      namespace: str) -> None:
    """The example PDDeployment, reconciled once as the operator would: its agent
    ServiceAccount, Role and RoleBinding, and the instances' pods the agents pose as."""
    k8s.CustomObjectsApi(kube_client).create_namespaced_custom_object(
        GROUP, VERSION, namespace, "pddeployments", example_body(namespace))
    kube = KubeClient(control_plane.api_client())
    try:
        Reconciler(kube, Capabilities(pod_disruption_budgets=False)).reconcile(namespace, NAME)
    finally:
        kube.close()


def instance_pod(core: k8s.CoreV1Api, namespace: str, role: str) -> tuple[str, str]:
    """The name and uid of the role's first engine instance's pod, once it exists."""
    def read() -> tuple[str, str] | None:
        pods = core.list_namespaced_pod(namespace, label_selector=(
            f"pd.serving.dev/deployment={NAME},pd.serving.dev/role={role}")).items
        first = sorted(pods, key=lambda p: int(p.metadata.name.rsplit("-", 1)[-1]))[:1]
        return (str(first[0].metadata.name), str(first[0].metadata.uid)) if first else None

    found: tuple[str, str] = wait_for(f"the {role} instance's pod", read, timeout_s=60)
    return found


@contextmanager
def agent_process(role: str, env: dict[str, str], engine: VllmServer, metrics_port: int,
                  log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`pd-transfer agent` for `role`'s pod, reading `engine`; SIGTERM on exit, and the test
    fails unless it then exits 0."""
    argv = [sys.executable, "-m", "pd_transfer.cli", "agent", "--engine", "vllm",
            "--engine-metrics-url", f"http://127.0.0.1:{engine.port}/metrics",
            "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port)]
    with log.open("ab") as out:
        process = subprocess.Popen(argv, env={**env, "PD_ROLE": role},
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            state = process_state(process.pid)
            process.kill()
            process.wait(timeout=120)  # reaped here, not by a later test's garbage collector
            pytest.fail(f"pd-transfer agent ({role}) still ran 30 s after SIGTERM ({state}); "
                        f"its log: {log.read_text()[-3000:]}")
        assert code == 0, f"pd-transfer agent ({role}) exited {code}: {log.read_text()[-3000:]}"


def process_state(pid: int) -> str:
    """Each thread's scheduler state and kernel wait channel, from /proc (why a process
    does not exit)."""
    threads = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            stat = (task / "stat").read_text()
            wchan = (task / "wchan").read_text()
        except OSError:
            continue
        threads.append(f"{task.name}:{stat.rsplit(')', 1)[1].split()[0]}/{wchan or '-'}")
    return "threads " + " ".join(threads) if threads else "no threads readable"


def stop_all(engines: list[VllmServer]) -> None:
    for engine in engines:
        engine.stop()


def status_of(objects: k8s.CustomObjectsApi, namespace: str,
              pod: str) -> TransferAgentStatus | None:
    try:
        obj = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, "transferagents",
                                                   pod)
    except ApiException:
        return None
    if not obj.get("status"):
        return None
    return TransferAgentStatus.model_validate(obj["status"])


def warm_up(prefill: VllmServer, decode: VllmServer, attempts: int = 5) -> int:
    """P/D requests until one answers; returns how many failed first (on a loaded machine a
    first NIXL handshake can miss vLLM's 5 s side-channel timeout: HTTP 500)."""
    for attempt in range(1, attempts + 1):
        try:
            nixl_pd_complete(prefill, decode, prompt_ids(64, seed=10_000 + attempt), 2)
            return attempt - 1
        except Exception:
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


def test_sidecar_reports_healthy_then_failing_vllm_nixl_decode(
        control_plane: ControlPlaneHandle, kube_client: k8s.ApiClient, namespace: str,
        tmp_path: Path) -> None:
    """Guards against a fleet that looks Ready and serves nothing: a decode whose KV heads
    differ from its prefill's fails every request while /health stays 200; its pod's
    TransferAgent must say so (healthy false, failures by reason) within one report window."""
    vllm = vllm_env_or_skip()
    reconcile_example(control_plane, kube_client, namespace)
    core, objects = k8s.CoreV1Api(kube_client), k8s.CustomObjectsApi(kube_client)
    pods = {role: instance_pod(core, namespace, role) for role in ("prefill", "decode")}
    names = {role: name for role, (name, _) in pods.items()}
    uids = {role: uid for role, (_, uid) in pods.items()}
    kubeconfig = service_account_kubeconfig(control_plane, namespace,
                                            agent_service_account(NAME))
    config = pd_transfer_config(MODEL, 8998)
    config["reporting"] = {"report_interval_seconds": REPORT_INTERVAL_S,
                           "window_seconds": WINDOW_S, "max_failure_ratio": 0.05}
    config_file = tmp_path / "transfer.json"
    config_file.write_text(json.dumps(config))
    base_env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(sys.path),
                "KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": namespace, "POD_IP": "127.0.0.1",
                "PD_DEPLOYMENT": NAME, "PD_TRANSFER_CONFIG": str(config_file)}
    prefill, decode = nixl_server_pair(vllm, MODEL.write(tmp_path / "kv2", vllm), tmp_path,
                                       extra_config=LEASE)
    _, mismatched = nixl_server_pair(vllm, MISMATCHED.write(tmp_path / "kv1", vllm), tmp_path,
                                     extra_config=LEASE)
    mismatched.role, mismatched.port = "decode-mismatch", decode.port  # the same pod's engine
    prefill_metrics, decode_metrics = free_ports(2)

    with ExitStack() as stack:
        stack.callback(mismatched.stop)
        stack.callback(decode.stop)
        stack.callback(prefill.stop)
        start_servers([prefill, decode])
        for role, engine, port in (("prefill", prefill, prefill_metrics),
                                   ("decode", decode, decode_metrics)):
            stack.enter_context(agent_process(role, {**base_env, "POD_UID": uids[role],
                                                          "POD_NAME": names[role]},
                                              engine, port, tmp_path / f"agent-{role}.log"))
        # The engines stop before their sidecars, as the sidecars must exit on SIGTERM, not
        # be starved of CPU by an engine's spinning NIXL threads while they do.
        stack.callback(stop_all, [prefill, decode, mismatched])

        # Phase 1: healthy traffic, once both sidecars have reported (as in a pod, where
        # the engine takes far longer to start than its sidecar).
        for role in ("prefill", "decode"):
            wait_for(f"the {role} agent's first report",
                     lambda role=role: status_of(objects, namespace, names[role]), timeout_s=60)
        warm_up(prefill, decode)
        # One more: NixlConnector on 2 loaded CPU cores takes seconds a request.
        nixl_pd_complete(prefill, decode, prompt_ids(96, seed=0), 4)
        # The engine's own count of finished READs rides along, so that a timeout shows
        # whether the engine or its sidecar fell short.
        healthy, _ = wait_for(
            "the decode's TransferAgent to report the 2 answered transfers (status, the "
            "engine's vllm:nixl_xfer_time_seconds_count)",
            lambda: (status_of(objects, namespace, names["decode"]),
                     scrape_sum(f"127.0.0.1:{decode.port}", "vllm:nixl_xfer_time_seconds_count")),
            timeout_s=60, interval_s=1.0,
            until=lambda seen: seen[0] is not None
            and seen[0].transfers_total - seen[0].failures_total >= 2)
        assert healthy.bytes_total > 0 and healthy.window.transfers >= 2
        assert healthy.window.transfer_time is not None
        assert healthy.window.transfer_time.count >= 2
        assert healthy.unknown == ["agents", "peers", "pendingKV", "ring", "transports"]
        assert healthy.incarnation.startswith(uids["decode"] + "-")
        assert healthy.staging is None
        # A failed warm-up may or may not have reached NIXL (a first handshake that misses
        # vLLM's side-channel timeout counts; a prefill step that timed out does not): the
        # engine's own counter, read directly, is what the agent must have reported.
        engine_failed = scrape_sum(f"127.0.0.1:{decode.port}",
                                   "vllm:nixl_num_failed_transfers_total")
        if engine_failed == 0:
            assert (healthy.healthy, healthy.failures_total, healthy.last_error) == (True, 0, "")
        else:  # a failed first handshake is a failure the agent must report, not hide
            assert healthy.failures_by_reason == {"TransferFailed": int(engine_failed)}
            window = healthy.window
            assert healthy.healthy is (window.failures <= 0.05 * window.transfers)
        # A prefill engine too busy to answer its sidecar past the busy grace (the requests
        # above, on 2 cores) is reported unhealthy until a reading succeeds again: idle now,
        # it must come back healthy within a few readings.
        try:
            on_prefill = wait_for(
                "the prefill's TransferAgent healthy",
                lambda: status_of(objects, namespace, names["prefill"]), timeout_s=120,
                until=lambda s: s is not None and s.healthy is True)
        except pytest.fail.Exception:
            last = status_of(objects, namespace, names["prefill"])
            pytest.fail(f"the prefill's TransferAgent is not healthy: "
                        f"{last.last_error if last else 'no status'}; its log: "
                        f"{(tmp_path / 'agent-prefill.log').read_text()[-3000:]}")
        assert {"bytesTotal", "transfersTotal", "window.transfers"} <= set(on_prefill.unknown)
        assert scrape(f"127.0.0.1:{decode_metrics}", "pd_transfer_native_engine_reading_ok",
                      engine="vllm", version="0.32.0") == 1.0

        # Phase 2: the decode's engine comes back with other KV heads than its prefill.
        decode.stop()
        start_servers([mismatched])
        answers = []
        for i in range(2):
            try:
                nixl_pd_complete(prefill, mismatched, prompt_ids(96, seed=50 + i), 4)
                answers.append("answered")
            except Exception as exc:  # vLLM answers HTTP 500
                answers.append(str(exc)[:60])
        failed_at = time.monotonic()
        assert all("answered 500" in a for a in answers), answers
        failing = wait_for(
            "the decode's TransferAgent to report the restarted engine's failures",
            lambda: status_of(objects, namespace, names["decode"]), timeout_s=WINDOW_S,
            until=lambda s: s is not None and s.incarnation != healthy.incarnation
            and s.healthy is False and s.failures_total > 0)
        reported_after_s = time.monotonic() - failed_at
        print(f"failures reported {reported_after_s:.1f} s after the last failed request")
        # A reading every report interval, a reporter tick a second later, then the write:
        # ~3 s; bounded here by the one report window the agent is given (on a loaded 2-core
        # machine a reading can time out and an API write be retried).
        assert reported_after_s <= WINDOW_S, reported_after_s
        assert set(failing.failures_by_reason) == {"TransferFailed"}
        assert failing.window.failures_by_reason["TransferFailed"] >= failing.failures_total
        # Unhealthy by its failures alone; the last error names them, unless a later reading
        # of the (busy) engine timed out past the sidecar's grace, which it then names.
        assert failing.window.failures > 0.05 * failing.window.transfers
        assert failing.last_error.startswith((
            "vllm:nixl_num_failed_transfers_total +",
            "agent error: the engine's metrics have not been read for ")), failing.last_error
        assert failing.incarnation.startswith(uids["decode"] + "-")
        assert complete(mismatched, [3], 1).token_ids  # the engine itself still serves
        after: Any = scrape(f"127.0.0.1:{decode_metrics}",
                            "pd_transfer_native_engine_incarnations_total", engine="vllm",
                            version="0.32.0")
        assert after == 2.0
