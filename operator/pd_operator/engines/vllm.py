"""vLLM: its OpenAI server with PDTransferConnector (PDTransfer) or NixlConnector (EngineNative)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar

from pd_contract.defaults import TRANSFER_METRICS_PORT
from pd_contract.names import ENV_POD_NAMESPACE
from pd_contract.transferagent import Role
from pd_operator.api.resources import PDDeployment
from pd_operator.api.spec import Framework, KVDtype
from pd_operator.engines.base import EngineAdapter, role_spec, runs_pd_transfer

__all__ = ["ADAPTER", "CONNECTOR_MODULE", "VLLMAdapter"]

_KV_DTYPE = {KVDtype.FP8_E4M3: "fp8_e4m3", KVDtype.FP8_E5M2: "fp8_e5m2"}
# `python3 -m` rather than the `vllm` console script: it starts the same server in the
# official images and in builds whose package metadata renames the distribution.
_SERVER = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
CONNECTOR_MODULE = "pd_transfer.vllm.connector"
_KV_ROLE = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}


class VLLMAdapter(EngineAdapter):
    """PDTransfer (default): `PDTransferConnector` loaded through vLLM's
    `kv_connector_module_path`, reading the pod's transfer config and key from the paths in
    its environment. EngineNative: vLLM's own NixlConnector."""

    framework: ClassVar[Framework] = Framework.VLLM
    # The NixlConnector's side channel, at vLLM's default port.
    native_agent_engine: ClassVar[str | None] = "vllm"
    native_bootstrap_port: ClassVar[int | None] = 5600

    def kv_transfer_config(self, pdd: PDDeployment, role: Role) -> dict[str, Any]:
        """vLLM's `--kv-transfer-config` for the pod's backend."""
        if runs_pd_transfer(pdd):
            return {"kv_connector": "PDTransferConnector",
                    "kv_connector_module_path": CONNECTOR_MODULE,
                    "kv_role": _KV_ROLE[role],
                    # vLLM's config does not carry its own port: the agent reports it.
                    "kv_connector_extra_config": {"engine_port": pdd.spec.engine.port}}
        config: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        if role_spec(pdd, role).effective_gpus_per_pod == 0:
            config["kv_buffer_device"] = "cpu"  # vLLM's CPU backend keeps KV in host memory
        return config

    def command(self, pdd: PDDeployment, role: Role) -> list[str]:
        spec = pdd.spec
        rs = role_spec(pdd, role)
        par = rs.parallelism
        cmd = [
            *_SERVER,
            "--model", spec.model.source,
            "--served-model-name", spec.model.name,
            "--host", "0.0.0.0",
            "--port", str(spec.engine.port),
            "--tensor-parallel-size", str(par.tensor),
            "--pipeline-parallel-size", str(par.pipeline),
            "--block-size", str(rs.page_size),
            "--kv-transfer-config",
            json.dumps(self.kv_transfer_config(pdd, role), separators=(",", ":")),
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
        """EngineNative: where the NixlConnector serves its side channel (the pod IP, the
        bootstrap port). PDTransfer reads everything from the transfer config."""
        if runs_pd_transfer(pdd):
            return []
        return [
            {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
             "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(self.bootstrap_port(pdd))},
        ]


    def drain_command(self, pdd: PDDeployment, role: Role, timeout_s: int) -> list[str]:
        """`pd-transfer drain` (the vLLM image carries this project's wheel): vLLM's queues,
        and with PDTransfer the connector's requests whose KV is held or loading."""
        cmd = ["pd-transfer", "drain", "--role", role.value, "--engine", "vllm",
               "--engine-metrics-url", f"http://127.0.0.1:{pdd.spec.engine.port}/metrics"]
        if runs_pd_transfer(pdd):
            cmd += ["--connector-metrics-url",
                    f"http://127.0.0.1:{TRANSFER_METRICS_PORT}/metrics"]
        return [*cmd, "--timeout-seconds", str(timeout_s)]

    def router_command(
        self, pdd: PDDeployment, prefill_urls: Sequence[str], decode_urls: Sequence[str]
    ) -> list[str]:
        """pd_transfer's router, which finds the engines by watching their pods (so a pod
        that turns unready, e.g. its transfer health gate, leaves the rotation at once);
        its settings come from the environment (`router_env`), `router.args` override."""
        return ["pd-transfer", "router"]

    def router_env(self, pdd: PDDeployment) -> list[dict[str, Any]]:
        protocol = "pd-transfer" if runs_pd_transfer(pdd) else "vllm-nixl"
        return [
            {"name": "PD_ROUTER_PROTOCOL", "value": protocol},
            {"name": "PD_ROUTER_DISCOVERY", "value": "kubernetes"},
            {"name": "PD_ROUTER_DEPLOYMENT", "value": pdd.metadata.name},
            {"name": ENV_POD_NAMESPACE,
             "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "PD_ROUTER_ENGINE_PORT", "value": str(pdd.spec.engine.port)},
            {"name": "PD_ROUTER_BOOTSTRAP_PORT", "value": str(self.bootstrap_port(pdd))},
        ]

    def router_reads_pods(self, pdd: PDDeployment) -> bool:
        return True

    def router_health_path(self, pdd: PDDeployment) -> str | None:
        return "/health"


ADAPTER = VLLMAdapter()
