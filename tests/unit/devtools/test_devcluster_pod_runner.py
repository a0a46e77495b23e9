"""The fake kubelet's launch plans: which containers run, with which interpreter, on which
address (pure; no process is started)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s_client

from pd_contract.transferagent import Role
from pd_devcluster.kubelet import FakeKubelet, _niceness
from pd_devcluster.pod_runner import (
    VLLM_SERVER_MODULE,
    LaunchPlan,
    NotRunnable,
    Probe,
    missing_resources,
    package_roots,
    plan_launch,
)
from pd_operator.build.pod import build_pod_template
from pd_testbed.factories import make_pdd

VLLM_PYTHON = Path("/venvs/vllm/bin/python")
IP = "127.0.1.7"


def container_of(framework: str, role: Role = Role.DECODE, **overrides: Any) -> dict[str, Any]:
    pdd = make_pdd("tiny", "dev", engine={"framework": framework, "image": "img:1",
                                          "port": 8000}, **overrides)
    container: dict[str, Any] = build_pod_template(pdd, role)["spec"]["containers"][0]
    return container


def plan(container: dict[str, Any]) -> Any:
    return plan_launch(container["command"] + container.get("args", []), container, IP,
                       vllm_python=lambda: VLLM_PYTHON)


def test_reference_engine_runs_with_this_interpreter() -> None:
    launch = plan(container_of("reference"))
    assert launch.argv == [sys.executable, "-m", "pd_transfer.cli", "engine", "--role",
                           "decode", "--config", "/etc/pd-transfer/transfer.json", "--port",
                           "8000"]
    assert launch.env == {}
    assert launch.readiness == Probe(8000, "/health")


def test_vllm_pd_transfer_listens_on_the_pod_address_only() -> None:
    """Guards against two vLLM pods on one host fighting over 0.0.0.0:<port> (the server)
    and 0.0.0.0:<bootstrap> (the connector's rank servers and the pod agent's metrics)."""
    launch = plan(container_of("vllm"))
    argv = launch.argv
    assert argv[:3] == [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--host") + 1] == IP
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == {
        "kv_connector": "PDTransferConnector",
        "kv_connector_module_path": "pd_transfer.vllm.connector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"engine_port": 8000, "bind_host": IP},
    }
    roots = launch.env["PYTHONPATH"].split(":")
    assert roots == package_roots("pd_transfer", "pd_contract")
    assert all((Path(root) / package).is_dir() for root, package in
               zip(roots, ("pd_transfer", "pd_contract"), strict=False))
    assert launch.readiness == Probe(8000, "/health")


def test_vllm_engine_native_keeps_its_connector_config() -> None:
    container = container_of("vllm", transfer={"backend": "EngineNative"})
    argv = plan(container).argv
    assert argv[argv.index("--host") + 1] == IP
    assert argv[argv.index("--kv-transfer-config") + 1] == (
        '{"kv_connector":"NixlConnector","kv_role":"kv_both"}')


def test_router_pod_runs_pd_transfer_router_with_its_health_probe() -> None:
    container = {"command": ["pd-transfer", "router"],
                 "ports": [{"name": "http", "containerPort": 8000}],
                 "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}}}
    launch = plan(container)
    assert launch.argv == [sys.executable, "-m", "pd_transfer.cli", "router", "--host", IP]
    assert launch.readiness == Probe(8000, "/health")
    given = {**container, "command": ["pd-transfer", "router", "--host", "0.0.0.0"]}
    assert plan(given).argv[-2:] == ["--host", IP]


def test_tcp_probe_and_numeric_port() -> None:
    container = {"command": ["pd-transfer", "engine", "--port", "9000"],
                 "readinessProbe": {"tcpSocket": {"port": 9000}}}
    assert plan(container).readiness == Probe(9000, None)


@pytest.mark.parametrize("command", [
    ["python3", "-m", "sglang.launch_server", "--model-path", "m"],
    ["vllm", "serve", "m"],
    ["pd-transfer"],
])
def test_other_containers_are_not_runnable(command: list[str]) -> None:
    with pytest.raises(NotRunnable, match=r"runs `pd-transfer \.\.\.` and vLLM.s OpenAI server"):
        plan({"command": command})


def test_unknown_probe_port_is_refused_naming_the_ports() -> None:
    container = {"command": ["pd-transfer", "router"],
                 "ports": [{"name": "http", "containerPort": 8000}],
                 "readinessProbe": {"httpGet": {"path": "/health", "port": "metrics"}}}
    with pytest.raises(NotRunnable, match=r"'metrics' is neither a number nor a named "
                                          r"container port \(\['http'\]\)"):
        plan(container)


def test_vllm_pod_without_the_vllm_env_is_not_runnable() -> None:
    def missing() -> Path:
        raise NotRunnable("the vLLM virtualenv is not built")

    container = container_of("vllm")
    with pytest.raises(NotRunnable, match="not built"):
        plan_launch(container["command"], container, IP, vllm_python=missing)


def test_transfer_agent_sidecar_reaches_its_engine_on_the_pod_address() -> None:
    """Containers of a pod share its network; here each pod is a loopback address, so the
    sidecar's http://127.0.0.1:<port> is the pod's address, and it serves its own metrics
    there rather than on every pod's."""
    container = container_of("vllm", transfer={"backend": "EngineNative"})
    pdd = make_pdd("tiny", "dev", engine={"framework": "vllm", "image": "img:1", "port": 8000},
                   transfer={"backend": "EngineNative"})
    agent = build_pod_template(pdd, Role.DECODE)["spec"]["containers"][1]
    assert container["name"] == "engine" and agent["name"] == "transfer-agent"
    assert plan(agent).argv == [
        sys.executable, "-m", "pd_transfer.cli", "agent", "--engine", "vllm",
        "--engine-metrics-url", f"http://{IP}:8000/metrics", "--engine-bootstrap-port",
        "5600", "--metrics-host", IP]


class _Handle:
    """What FakeKubelet's constructor reads of a control plane: a client it never calls."""

    def api_client(self) -> k8s_client.ApiClient:
        return k8s_client.ApiClient()


def test_vllm_engines_get_a_cpu_per_rank_round_robin_and_a_pod_choice_wins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {4, 7})
    kubelet = FakeKubelet(_Handle(), tmp_path)  # type: ignore[arg-type]
    engine = LaunchPlan(["/venv/bin/python", "-m", VLLM_SERVER_MODULE, "--port", "8000"])
    tp2 = LaunchPlan([*engine.argv, "--tensor-parallel-size", "2"])
    agent = LaunchPlan([sys.executable, "-m", "pd_transfer.cli", "agent"])
    assert kubelet._cpus_for(engine, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "4"}
    assert kubelet._cpus_for(agent, {}) == {}  # not an engine: no binding
    assert kubelet._cpus_for(tp2, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "7|4"}
    assert kubelet._cpus_for(engine, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "7"}
    assert kubelet._cpus_for(engine, {"VLLM_CPU_OMP_THREADS_BIND": "all"}) == {}


def test_only_vllm_engines_run_behind_the_control_plane() -> None:
    engine = LaunchPlan(["/venv/bin/python", "-m", VLLM_SERVER_MODULE, "--port", "8000"])
    agent = LaunchPlan([sys.executable, "-m", "pd_transfer.cli", "agent"])
    router = LaunchPlan([sys.executable, "-m", "pd_transfer.cli", "router"])
    assert [_niceness(plan) for plan in (engine, agent, router)] == [10, 0, 0]


def test_pods_asking_for_gpus_or_rdma_stay_pending_cpu_and_memory_do_not() -> None:
    """The demo's GPU examples must not be started (and crash-loop) on a CPU host."""
    def pod(*resources: dict[str, Any]) -> dict[str, Any]:
        return {"spec": {"containers": [{"name": f"c{i}", "resources": r}
                                        for i, r in enumerate(resources)]}}

    cpu_only = pod({"requests": {"cpu": "500m", "memory": "2Gi"}}, {})
    assert missing_resources(cpu_only) == []
    assert missing_resources(pod({"limits": {"hugepages-2Mi": "1Gi",
                                             "ephemeral-storage": "1Gi"}})) == []
    gpu = pod({"requests": {"cpu": "16"}, "limits": {"nvidia.com/gpu": "4"}},
              {"requests": {"rdma/ib": "1"}, "limits": {"rdma/ib": "1"}})
    assert missing_resources(gpu) == ["nvidia.com/gpu", "rdma/ib"]
    assert missing_resources(pod({"limits": {"nvidia.com/gpu": "0"}})) == []
    assert missing_resources(gpu, offered=("rdma/ib",)) == ["nvidia.com/gpu"]
