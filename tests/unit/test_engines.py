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
    KVConnector,
    StagingOperation,
    engine_adapter,
)
from pd_operator.engines.reference import ReferenceAdapter
from pd_operator.engines.sglang import SGLangAdapter
from pd_operator.engines.vllm import VLLMAdapter
from tests.factories import make_pdd

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


@pytest.mark.parametrize(
    ("adapter", "connector", "reports", "staging", "port"),
    [
        (ReferenceAdapter(), KVConnector.PD_TRANSFER, True,
         frozenset({StagingOperation.RESIZE}), 8998),
        (SGLangAdapter(), KVConnector.NATIVE, False, frozenset(), 8998),
        (VLLMAdapter(), KVConnector.NATIVE, False, frozenset(), 5600),
    ],
    ids=["reference", "sglang", "vllm"],
)
def test_framework_facts(
    adapter: EngineAdapter, connector: KVConnector, reports: bool,
    staging: frozenset[StagingOperation], port: int,
) -> None:
    assert adapter.kv_connector is connector
    assert adapter.reports_transfer_health is reports
    assert adapter.staging_operations == staging
    assert adapter.bootstrap_port == port


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
        "--disaggregation-bootstrap-port", "8998", "--dp-size", "2", "--enable-dp-attention",
        "--disaggregation-ib-device", "mlx5_0,mlx5_1",
    ]
    assert adapter.env(pdd, Role.DECODE) == []
    assert adapter.router_command(pdd, PREFILL_URLS, DECODE_URLS) == [
        "python3", "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", "http://p-0:30000", "8998",
        "--decode", "http://d-0:30000", "--decode", "http://d-1:30000",
        "--policy", "cache_aware", "--host", "0.0.0.0", "--port", "8000",
    ]


def test_vllm_adapter() -> None:
    pdd = pdd_of(
        "vllm",
        model={"name": "tiny", "source": "/models/tiny", "numLayers": 4, "numKVHeads": 2,
               "headDim": 8, "kvDtype": "fp8_e5m2"},
    )
    adapter = VLLMAdapter()
    assert adapter.command(pdd, Role.PREFILL) == [
        "vllm", "serve", "/models/tiny", "--served-model-name", "tiny", "--host", "0.0.0.0",
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
    assert adapter.router_command(pdd, PREFILL_URLS, DECODE_URLS) is None
    assert adapter.ports(pdd)[1] == {"name": "kv-bootstrap", "containerPort": 5600,
                                     "protocol": "TCP"}
