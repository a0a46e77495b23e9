"""vLLM (`vllm serve` with its NixlConnector)."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.api.spec import Framework, KVDtype
from pd_operator.engines.base import EngineAdapter, KVConnector, StagingOperation, role_spec

__all__ = ["ADAPTER", "VLLMAdapter"]

_KV_DTYPE = {KVDtype.FP8_E4M3: "fp8_e4m3", KVDtype.FP8_E5M2: "fp8_e5m2"}


class VLLMAdapter(EngineAdapter):
    """vLLM moves KV with its own NixlConnector; its pods report no TransferAgent."""

    framework: ClassVar[Framework] = Framework.VLLM
    kv_connector: ClassVar[KVConnector] = KVConnector.NATIVE
    reports_transfer_health: ClassVar[bool] = False
    staging_operations: ClassVar[frozenset[StagingOperation]] = frozenset()
    # The NixlConnector's side channel, at vLLM's default port.
    bootstrap_port: ClassVar[int] = 5600

    def command(self, pdd: PDDeployment, role: Role) -> list[str]:
        spec = pdd.spec
        rs = role_spec(pdd, role)
        par = rs.parallelism
        kv_transfer = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        cmd = [
            "vllm", "serve", spec.model.source,
            "--served-model-name", spec.model.name,
            "--host", "0.0.0.0",
            "--port", str(spec.engine.port),
            "--tensor-parallel-size", str(par.tensor),
            "--pipeline-parallel-size", str(par.pipeline),
            "--block-size", str(rs.page_size),
            "--kv-transfer-config", json.dumps(kv_transfer, separators=(",", ":")),
        ]
        if par.data > 1:
            cmd += ["--data-parallel-size", str(par.data)]
        if role is Role.PREFILL:
            cmd += ["--enable-chunked-prefill",
                    "--max-num-batched-tokens", str(spec.prefill.chunked_prefill_tokens)]
        if spec.model.kv_dtype in _KV_DTYPE:
            cmd += ["--kv-cache-dtype", _KV_DTYPE[spec.model.kv_dtype]]
        return cmd

    def env(self, pdd: PDDeployment, role: Role) -> list[dict[str, Any]]:
        """Where the NixlConnector serves its side channel: the pod IP, the bootstrap port."""
        return [
            {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
             "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(self.bootstrap_port)},
        ]


ADAPTER = VLLMAdapter()
