"""Engine adapters: the registry covers each framework once; each adapter's answers."""

from __future__ import annotations

from typing import Any

import pytest

from pd_contract.transferagent import Role
from pd_operator.api import PDDeployment
from pd_operator.api.spec import Framework
from pd_operator.engines import (
    ADAPTERS,
    EngineAdapter,
    StagingOperation,
    engine_adapter,
    runs_pd_transfer,
)
from pd_operator.engines.reference import ReferenceAdapter
from pd_operator.engines.sglang import SGLangAdapter
from pd_operator.engines.vllm import VLLMAdapter
from pd_testbed.factories import make_pdd

PREFILL_URLS = ["http://p-0:30000"]
DECODE_URLS = ["http://d-0:30000", "http://d-1:30000"]


def pdd_of(framework: str, **overrides: Any) -> PDDeployment:
    return make_pdd(
        "tiny",
        "serving",
        **{
            "model": {"name": "tiny", "source": "/models/tiny", "numLayers": 4,
                      "numKVHeads": 2, "headDim": 8},
            "engine": {"framework": framework, "image": "img:1"},
            "prefill": {"replicas": 1, "parallelism": {"tensor": 1}},
            "decode": {"replicas": 2, "parallelism": {"tensor": 2}},
            "network": {"rdma": {"enabled": False, "required": False}},
            **overrides,
        },
    )


def test_registry_has_one_adapter_per_framework() -> None:
    assert set(ADAPTERS) == set(Framework)
    assert {type(a) for a in ADAPTERS.values()} == {ReferenceAdapter, SGLangAdapter, VLLMAdapter}
    for framework, adapter in ADAPTERS.items():
        assert adapter.framework is framework
        assert isinstance(adapter, EngineAdapter)
    assert isinstance(engine_adapter(pdd_of("vllm")), VLLMAdapter)


def test_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        ADAPTERS[Framework.VLLM] = ReferenceAdapter()  # type: ignore[index]


RESIZE = frozenset({StagingOperation.RESIZE})


@pytest.mark.parametrize(
    ("framework", "backend", "pd_transfer", "staging", "port"),
    [
        ("reference", None, True, RESIZE, 8998),
        ("reference", "PDTransfer", True, RESIZE, 8998),
        ("sglang", None, False, frozenset(), 8998),
        ("sglang", "EngineNative", False, frozenset(), 8998),
        ("vllm", None, True, RESIZE, 8998),
        ("vllm", "PDTransfer", True, RESIZE, 8998),
        ("vllm", "EngineNative", False, frozenset(), 5600),
    ],
    ids=["reference", "reference-pd", "sglang", "sglang-native", "vllm", "vllm-pd",
         "vllm-native"],
)
def test_backend_facts(framework: str, backend: str | None, pd_transfer: bool,
                       staging: frozenset[StagingOperation], port: int) -> None:
    """Each framework's default backend (PDTransfer for vllm and reference, EngineNative for
    sglang) and what it implies: who reports (pd_transfer's agent, or the transfer-agent
    sidecar from the engine's metrics: every pod reports), what may be resized, where
    metadata goes."""
    pdd = pdd_of(framework, transfer={"backend": backend} if backend else {})
    adapter = engine_adapter(pdd)
    assert runs_pd_transfer(pdd) is pd_transfer
    assert adapter.reports_transfer_health(pdd) is True
    assert adapter.runs_native_agent(pdd) is not pd_transfer
    assert adapter.staging_operations(pdd) == staging
    assert adapter.bootstrap_port(pdd) == port


def test_reference_adapter() -> None:
    pdd = pdd_of("reference")
    adapter = ReferenceAdapter()
    assert adapter.command(pdd, Role.DECODE) == [
        "pd-transfer", "engine", "--role", "decode",
        "--config", "/etc/pd-transfer/transfer.json", "--port", "30000",
    ]
    assert adapter.env(pdd, Role.PREFILL) == []
    assert adapter.router_command(pdd, PREFILL_URLS, DECODE_URLS) is None
    assert adapter.ports(pdd) == [
        {"name": "http", "containerPort": 30000, "protocol": "TCP"},
        {"name": "kv-bootstrap", "containerPort": 8998, "protocol": "TCP"},
        {"name": "kv-metrics", "containerPort": 9400, "protocol": "TCP"},
    ]
    http = {"path": "/health", "port": "http"}
    assert adapter.probes(pdd) == {
        "startupProbe": {"httpGet": http, "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {"httpGet": http, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": http, "periodSeconds": 15, "failureThreshold": 4,
                          "timeoutSeconds": 5},
    }


def test_sglang_adapter() -> None:
    pdd = pdd_of(
        "sglang",
        decode={"replicas": 2, "parallelism": {"tensor": 4, "data": 2}},
        network={"rdma": {"enabled": True, "required": True,
                          "ibDevices": ["mlx5_0:1", "mlx5_1:1"]}},
        router={"enabled": True, "image": "img:1", "policy": "cache-aware"},
    )
    adapter = SGLangAdapter()
    assert adapter.command(pdd, Role.DECODE) == [
        "python3", "-m", "sglang.launch_server", "--model-path", "/models/tiny",
        "--served-model-name", "tiny", "--host", "0.0.0.0", "--port", "30000",
        "--tp-size", "4", "--pp-size", "1", "--page-size", "16",
        "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl",
        "--disaggregation-bootstrap-port", "8998", "--enable-metrics", "--dp-size", "2",
        "--enable-dp-attention",
        "--disaggregation-ib-device", "mlx5_0,mlx5_1",
    ]
    assert adapter.env(pdd, Role.DECODE) == []
    assert adapter.router_command(pdd, PREFILL_URLS, DECODE_URLS) == [
        "python3", "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", "http://p-0:30000", "8998",
        "--decode", "http://d-0:30000", "--decode", "http://d-1:30000",
        "--policy", "cache_aware", "--host", "0.0.0.0", "--port", "8000",
    ]


def test_vllm_adapter_engine_native() -> None:
    pdd = pdd_of(
        "vllm",
        model={"name": "tiny", "source": "/models/tiny", "numLayers": 4, "numKVHeads": 2,
               "headDim": 8, "kvDtype": "fp8_e5m2"},
        transfer={"backend": "EngineNative"},
    )
    adapter = VLLMAdapter()
    assert adapter.command(pdd, Role.PREFILL) == [
        "python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/tiny",
        "--served-model-name", "tiny", "--host", "0.0.0.0",
        "--port", "30000", "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1",
        "--block-size", "16", "--kv-transfer-config",
        '{"kv_connector":"NixlConnector","kv_role":"kv_both"}',
        "--enable-chunked-prefill", "--max-num-batched-tokens", "8192",
        "--kv-cache-dtype", "fp8_e5m2",
    ]
    assert adapter.env(pdd, Role.PREFILL) == [
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
         "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": "5600"},
    ]
    assert adapter.ports(pdd) == [
        {"name": "http", "containerPort": 30000, "protocol": "TCP"},
        {"name": "kv-bootstrap", "containerPort": 5600, "protocol": "TCP"},
    ]


def test_vllm_adapter_engine_native_on_cpus_keeps_kv_in_host_memory() -> None:
    pdd = pdd_of("vllm", transfer={"backend": "EngineNative"},
                 decode={"replicas": 1, "gpusPerPod": 0})
    command = VLLMAdapter().command(pdd, Role.DECODE)
    assert command[command.index("--kv-transfer-config") + 1] == (
        '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}')


def test_vllm_adapter_pd_transfer() -> None:
    pdd = pdd_of("vllm", decode={"replicas": 1, "parallelism": {"tensor": 2}})
    adapter = VLLMAdapter()
    assert adapter.command(pdd, Role.DECODE) == [
        "python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/tiny",
        "--served-model-name", "tiny", "--host", "0.0.0.0",
        "--port", "30000", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
        "--block-size", "16", "--kv-transfer-config",
        '{"kv_connector":"PDTransferConnector","kv_connector_module_path":'
        '"pd_transfer.vllm.connector","kv_role":"kv_consumer",'
        '"kv_connector_extra_config":{"engine_port":30000}}',
    ]
    prefill = adapter.command(pdd, Role.PREFILL)
    assert prefill[prefill.index("--kv-transfer-config") + 1] == (
        '{"kv_connector":"PDTransferConnector","kv_connector_module_path":'
        '"pd_transfer.vllm.connector","kv_role":"kv_producer",'
        '"kv_connector_extra_config":{"engine_port":30000}}')
    assert adapter.env(pdd, Role.PREFILL) == []
    assert adapter.ports(pdd) == [
        {"name": "http", "containerPort": 30000, "protocol": "TCP"},
        {"name": "kv-bootstrap", "containerPort": 8998, "protocol": "TCP"},
        {"name": "kv-metrics", "containerPort": 9400, "protocol": "TCP"},
    ]
