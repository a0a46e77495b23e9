"""SGLang (`sglang.launch_server` in disaggregation mode) and its PD router, sglang_router."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.api.spec import Framework, KVDtype, RouterPolicy
from pd_operator.engines.base import EngineAdapter, role_spec

__all__ = ["ADAPTER", "SGLangAdapter"]

# --kv-cache-dtype: "auto" keeps the model dtype; fp8 variants are named explicitly.
_KV_DTYPE = {KVDtype.FP8_E4M3: "fp8_e4m3", KVDtype.FP8_E5M2: "fp8_e5m2"}

_POLICY = {
    RouterPolicy.ROUND_ROBIN: "round_robin",
    RouterPolicy.LEAST_LOAD: "power_of_two",
    RouterPolicy.CACHE_AWARE: "cache_aware",
}


class SGLangAdapter(EngineAdapter):
    """SGLang moves KV with its own NIXL backend (EngineNative, its only backend); the
    transfer-agent sidecar reports it from SGLang's metrics."""

    framework: ClassVar[Framework] = Framework.SGLANG
    native_agent_engine: ClassVar[str | None] = "sglang"
    native_bootstrap_port: ClassVar[int | None] = 8998

    def command(self, pdd: PDDeployment, role: Role) -> list[str]:
        spec = pdd.spec
        rs = role_spec(pdd, role)
        par = rs.parallelism
        cmd = [
            "python3", "-m", "sglang.launch_server",
            "--model-path", spec.model.source,
            "--served-model-name", spec.model.name,
            "--host", "0.0.0.0",
            "--port", str(spec.engine.port),
            "--tp-size", str(par.tensor),
            "--pp-size", str(par.pipeline),
            "--page-size", str(rs.page_size),
            "--disaggregation-mode", role.value,
            "--disaggregation-transfer-backend", "nixl",
            "--disaggregation-bootstrap-port", str(self.bootstrap_port(pdd)),
            # /metrics, which the transfer-agent sidecar reads, is off by default.
            "--enable-metrics",
        ]
        if par.data > 1:
            cmd += ["--dp-size", str(par.data), "--enable-dp-attention"]
        if role is Role.PREFILL:
            cmd += ["--chunked-prefill-size", str(spec.prefill.chunked_prefill_tokens)]
        if spec.model.kv_dtype in _KV_DTYPE:
            cmd += ["--kv-cache-dtype", _KV_DTYPE[spec.model.kv_dtype]]
        rdma = spec.network.rdma
        if rdma.enabled and rdma.ib_devices:
            devices = ",".join(dev.split(":")[0] for dev in rdma.ib_devices)
            cmd += ["--disaggregation-ib-device", devices]
        return cmd

    def router_command(
        self, pdd: PDDeployment, prefill_urls: Sequence[str], decode_urls: Sequence[str]
    ) -> list[str]:
        """sglang_router in PD mode, given every engine pod's stable URL (so it needs no API
        access; a change of replica counts rewrites its arguments and rolls it)."""
        router = pdd.spec.router
        cmd = ["python3", "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        for url in prefill_urls:
            cmd += ["--prefill", url, str(self.bootstrap_port(pdd))]
        for url in decode_urls:
            cmd += ["--decode", url]
        cmd += ["--policy", _POLICY[router.policy], "--host", "0.0.0.0",
                "--port", str(router.port)]
        return cmd


ADAPTER = SGLangAdapter()
