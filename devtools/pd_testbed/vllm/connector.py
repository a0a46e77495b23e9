"""vLLM servers running this project's PDTransferConnector, loaded from the checkout:
the transfer config document the operator would render, the deployment's key, one server
of a role (`pd_transfer_server`) or a pair (`pd_transfer_pair`), and P/D requests sent to
prefill and decode at once, as the router does (`pd_transfer_request`)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_devcluster.vllm_env import VllmEnv
from pd_testbed.vllm.completions import CompletionResult, complete
from pd_testbed.vllm.environment import cpu_binding, free_ports, role_core
from pd_testbed.vllm.model import ModelSpec
from pd_testbed.vllm.scrape import scrape
from pd_testbed.vllm.server import VllmServer

__all__ = ["PD_PIPELINE", "TEST_TIMEOUTS", "PdTransferPair", "PdTransferServer",
           "pd_transfer_args", "pd_transfer_complete", "pd_transfer_config", "pd_transfer_key",
           "pd_transfer_pair", "pd_transfer_request", "pd_transfer_server"]

PD_PIPELINE = {"enabled": True, "min_tokens": 128, "min_groups": 2, "max_groups": 4,
               "saturation": 4.0}


TEST_TIMEOUTS = {"bootstrap_seconds": 10.0, "grant_seconds": 1.0, "transfer_seconds": 30.0,
                 "kv_lease_seconds": 20.0}


def pd_transfer_config(model: ModelSpec, bootstrap_port: int, *, block_size: int = 32,
                       chunk_tokens: int | None = None,
                       timeouts: Mapping[str, float] | None = None,
                       prefill_tp: int = 1, decode_tp: int = 1) -> dict[str, Any]:
    """The transfer config document the operator would render for `model`."""
    role = {"pipeline": 1, "data": 1, "page_size": block_size, "service": "local"}
    return {
        "version": 1, "deployment": "vllm-local", "namespace": "default",
        "model": {"num_layers": model.layers, "num_kv_heads": model.kv_heads,
                  "head_dim": model.head_dim, "kv_dtype": model.dtype, "attention": "MHA"},
        "prefill": {**role, "tensor": prefill_tp, "chunk_tokens": chunk_tokens},
        "decode": {**role, "tensor": decode_tp},
        "layer_pipeline": PD_PIPELINE,
        "staging": {"mode": "Auto", "prefill_buffer_mib": 16, "decode_pool_mib": 16},
        "timeouts": {**TEST_TIMEOUTS, **(timeouts or {})},
        "reporting": {"report_interval_seconds": 5.0, "window_seconds": 60.0,
                      "max_failure_ratio": 0.05},
        "network": {"rdma_required": False, "bootstrap_port": bootstrap_port,
                    "metrics_port": 9400},
    }


def pd_transfer_args(kv_role: str, config_file: Path, key_file: Path, bootstrap_port: int,
                     timeline: Path, *, failure_policy: str | None = None,
                     extra: Mapping[str, Any] | None = None) -> list[str]:
    """`--kv-transfer-config` loading PDTransferConnector from the checkout;
    `failure_policy`: vLLM's `kv_load_failure_policy` ("fail", vLLM's default, or
    "recompute"); `extra`: more `kv_connector_extra_config` settings."""
    settings = {"config_file": str(config_file), "key_file": str(key_file),
                "bind_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
                "timeline_file": str(timeline), **(extra or {})}
    config: dict[str, Any] = {"kv_connector": "PDTransferConnector",
                              "kv_connector_module_path": "pd_transfer.vllm.connector",
                              "kv_role": kv_role, "kv_connector_extra_config": settings}
    if failure_policy is not None:
        config["kv_load_failure_policy"] = failure_policy
    return ["--kv-transfer-config", json.dumps(config)]


@dataclass(frozen=True)
class PdTransferServer:
    """A vLLM server running PDTransferConnector (not started), its bootstrap address
    (rank 0; rank r listens on the port after r) and its timeline files."""

    server: VllmServer
    bootstrap: str
    timeline_dir: Path
    name: str
    metrics: str  # the pod agent's Prometheus endpoint (host:port)

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample of the pod agent's metrics (None when absent)."""
        return scrape(self.metrics, name, **labels)

    def timeline(self, rank: int = 0) -> list[dict[str, Any]]:
        path = self.timeline_dir / f"{self.name}-r{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]


def pd_transfer_key(root: Path) -> Path:
    """The deployment's transfer key under `root` (written once, shared by its servers)."""
    root.mkdir(parents=True, exist_ok=True)
    key_file = root / "transfer.key"
    if not key_file.exists():
        key_file.write_text(secrets.token_hex(32) + "\n")
    return key_file


def pd_transfer_server(vllm: VllmEnv, model: ModelSpec, model_dir: Path, root: Path,
                       role: str, *, name: str | None = None,
                       failure_policy: str | None = None,
                       timeouts: Mapping[str, float] | None = None,
                       prefill_tp: int = 1, decode_tp: int = 1,
                       extra: Mapping[str, Any] | None = None,
                       env: Mapping[str, str] | None = None,
                       **server_options: Any) -> PdTransferServer:
    """One connector server of `role` ("prefill" or "decode") under `root`, with the
    deployment's key (`pd_transfer_key`) and its own transfer config; `name` (default: the
    role) names its log, config and timeline files; the server of `role` runs with that
    role's tensor parallelism (`prefill_tp` / `decode_tp`, vLLM's TP workers as processes)."""
    name = name or role
    key_file = pd_transfer_key(root)
    port, boot, metrics = free_ports(3)
    chunk = server_options.get("max_num_batched_tokens")
    config_file = root / f"{name}-transfer-config.json"
    config_file.write_text(json.dumps(pd_transfer_config(
        model, boot, chunk_tokens=chunk, timeouts=timeouts, prefill_tp=prefill_tp,
        decode_tp=decode_tp)))
    tp = prefill_tp if role == "prefill" else decode_tp
    timeline_dir = root / "timeline"
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    args = pd_transfer_args(kv_role, config_file, key_file, boot,
                            timeline_dir / f"{name}.jsonl", failure_policy=failure_policy,
                            extra={"metrics_port": metrics, **(extra or {})})
    bind = cpu_binding(tp) if tp > 1 else role_core(role)
    server = VllmServer(role=name, port=port, vllm=vllm, model_dir=model_dir, log_dir=root,
                        extra_args=args, tensor_parallel=tp,
                        env={"UCX_NET_DEVICES": "lo", "VLLM_CPU_OMP_THREADS_BIND": bind,
                             **(env or {})},
                        **server_options)
    return PdTransferServer(server, f"127.0.0.1:{boot}", timeline_dir, name,
                            f"127.0.0.1:{metrics}")


@dataclass(frozen=True)
class PdTransferPair:
    """A prefill and a decode server running PDTransferConnector (not started)."""

    prefill_side: PdTransferServer
    decode_side: PdTransferServer

    @property
    def prefill(self) -> VllmServer:
        return self.prefill_side.server

    @property
    def decode(self) -> VllmServer:
        return self.decode_side.server

    @property
    def prefill_bootstrap(self) -> str:
        return self.prefill_side.bootstrap

    @property
    def decode_bootstrap(self) -> str:
        return self.decode_side.bootstrap

    def timeline(self, role: str, rank: int = 0) -> list[dict[str, Any]]:
        side = self.prefill_side if role == "prefill" else self.decode_side
        return side.timeline(rank)


def pd_transfer_pair(vllm: VllmEnv, model: ModelSpec, model_dir: Path, root: Path,
                     **server_options: Any) -> PdTransferPair:
    """A prefill and a decode server sharing the deployment's key under `root`."""
    return PdTransferPair(
        pd_transfer_server(vllm, model, model_dir, root, "prefill", **server_options),
        pd_transfer_server(vllm, model, model_dir, root, "decode", **server_options))


def pd_transfer_request(prompt: Sequence[int], max_tokens: int, *, room: str,
                        prefill: str, decode: str, prefill_server: VllmServer,
                        decode_server: VllmServer, stream: bool = False,
                        timeout_s: float = 120.0,
                        prefill_must_answer: bool = True) -> CompletionResult:
    """Prefill and decode at once, as the router does: prefill told where decode is
    (`decode`: its bootstrap address) and decode where prefill is. Decode's result; the
    prefill request's error is raised too unless `prefill_must_answer` is False (a test
    that kills the prefill server)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(complete, prefill_server, prompt, 1,
                            {"pd_transfer": {"room": room, "decode": decode}},
                            timeout_s=timeout_s)
        try:
            result = complete(decode_server, prompt, max_tokens,
                              {"pd_transfer": {"room": room, "prefill": prefill}},
                              stream=stream, timeout_s=timeout_s)
        except RuntimeError as exc:
            # The HTTP answer says only "Internal server error"; the ranks' log lines for the
            # room say why (a failed load is logged with its reason), in the test's report.
            raise RuntimeError(
                f"{exc}\nroom {room} in {decode_server.role}'s log:\n"
                f"{decode_server.log_lines_naming(room)}\n"
                f"in {prefill_server.role}'s log:\n{prefill_server.log_lines_naming(room)}"
            ) from exc
        if prefill_must_answer:
            first.result()
    return result


def pd_transfer_complete(pair: PdTransferPair, prompt: Sequence[int], max_tokens: int, *,
                         room: str, stream: bool = False) -> CompletionResult:
    """Prefill and decode of `pair` at once, as the router does, under a room of the caller's."""
    return pd_transfer_request(prompt, max_tokens, room=room, prefill=pair.prefill_bootstrap,
                               decode=pair.decode_bootstrap, prefill_server=pair.prefill,
                               decode_server=pair.decode, stream=stream)
