"""Real vLLM servers (CPU backend) for end-to-end tests and benchmarks of KV connectors.

- `ModelSpec` writes a tiny Llama: `config.json` and a seeded random checkpoint
  (`model.safetensors`), so every server of one spec has the same weights whatever its
  tensor parallelism (vLLM's `--load-format dummy` fills each TP shard from the same seed,
  which gives a TP-2 server other weights than a TP-1 one), and greedy decoding is
  deterministic: two servers give the same token ids for the same prompt.
- `VllmServer` starts `python -m vllm.entrypoints.openai.api_server` from the cached vLLM
  virtualenv (`pd_devcluster.vllm_env`) in its own process group, waits for
  `/health`, and stops it (SIGTERM, then SIGKILL). `start_servers` starts several at once
  (vLLM's ~90 s startup is mostly CPU-light waiting, so parallel startup pays).
- `complete` sends token ids to `/v1/completions` and returns the generated token ids
  (vLLM's `return_token_ids`; the servers run without a tokenizer), the response's
  `kv_transfer_params`, and timings; with `stream=True` the TTFT is the time from sending
  the request to the first streamed token.
- `nixl_server_pair` / `nixl_pd_complete`: vLLM's own NixlConnector as the P/D baseline,
  driven the way vLLM's toy proxy does it (prefill with `do_remote_decode` and one token,
  then decode with the `kv_transfer_params` prefill returned).
- `vllm_env_or_skip` finds the vLLM env for a test: skip when it is missing, unless
  `PD_OPERATOR_REQUIRE_VLLM` is set (CI), then fail.
- `server_pythonpath` puts the checkout's `transfer/` and `contract/` package roots on the
  servers' `PYTHONPATH`, so `kv_connector_module_path="pd_transfer.vllm.connector"` imports
  the connector from this checkout.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import threading
import time
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pd_devcluster.kubelet import ENGINE_NICENESS
from pd_devcluster.vllm_env import VllmEnv, find_vllm_env, vllm_env_dir

__all__ = [
    "NIXL_PREFILL_PARAMS",
    "REQUIRE_VLLM_ENV",
    "CompletionResult",
    "HttpTarget",
    "ModelSpec",
    "PdFailed",
    "PdResult",
    "PdTransferPair",
    "PdTransferServer",
    "Server",
    "ServerDied",
    "VllmServer",
    "complete",
    "cpu_binding",
    "free_ports",
    "greedy_disagreement",
    "nixl_kv_transfer_config",
    "nixl_pd_complete",
    "nixl_server_pair",
    "pd_transfer_complete",
    "pd_transfer_config",
    "pd_transfer_key",
    "pd_transfer_pair",
    "pd_transfer_request",
    "pd_transfer_server",
    "prompt_ids",
    "running",
    "scrape",
    "server_pythonpath",
    "start_servers",
    "vllm_env_or_skip",
    "vllm_metric",
    "warm_up_pd",
]

REPO = Path(__file__).resolve().parents[2]
REQUIRE_VLLM_ENV = "PD_OPERATOR_REQUIRE_VLLM"
SERVED_MODEL_NAME = "tiny-llama"
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
_LOG_TAIL_LINES = 60


# --------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True)
class ModelSpec:
    """A tiny Llama (`config.json` and seeded random weights, `write`)."""

    layers: int = 3
    kv_heads: int = 2
    hidden: int = 256
    heads: int = 4
    vocab: int = 1024
    intermediate: int = 512
    max_position: int = 4096
    dtype: str = "bfloat16"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, in `dtype` (2 bytes for bf16/fp16, 4 for fp32)."""
        itemsize = 4 if self.dtype in ("float32", "float") else 2
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize

    def config(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "num_hidden_layers": self.layers,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_position,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "torch_dtype": self.dtype,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
        }

    def write(self, directory: Path, vllm: VllmEnv, *, seed: int = 0) -> Path:
        """Write `config.json` and `model.safetensors` (weights drawn from `seed`) into
        `directory` (created) and return it. The weights are written by the vLLM env's
        Python (torch and safetensors are there). Scales: embeddings N(0, 1), projections
        N(0, 1/fan_in), norms 1, so attention is far from uniform and a completion depends
        on the whole prompt's KV (a wrongly placed page changes the tokens)."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config(), indent=2) + "\n")
        shapes = self.weight_shapes()
        subprocess.run([str(vllm.python), "-c", _WRITE_WEIGHTS,
                        str(directory / "model.safetensors"), json.dumps(shapes), str(seed),
                        self.dtype], check=True, capture_output=True, timeout=300)
        return directory

    def weight_shapes(self) -> dict[str, list[int]]:
        """Hugging Face Llama parameter names and shapes."""
        hidden, kv = self.hidden, self.kv_heads * self.head_dim
        shapes = {"model.embed_tokens.weight": [self.vocab, hidden],
                  "model.norm.weight": [hidden], "lm_head.weight": [self.vocab, hidden]}
        for layer in range(self.layers):
            prefix = f"model.layers.{layer}."
            shapes |= {
                prefix + "self_attn.q_proj.weight": [hidden, hidden],
                prefix + "self_attn.k_proj.weight": [kv, hidden],
                prefix + "self_attn.v_proj.weight": [kv, hidden],
                prefix + "self_attn.o_proj.weight": [hidden, hidden],
                prefix + "mlp.gate_proj.weight": [self.intermediate, hidden],
                prefix + "mlp.up_proj.weight": [self.intermediate, hidden],
                prefix + "mlp.down_proj.weight": [hidden, self.intermediate],
                prefix + "input_layernorm.weight": [hidden],
                prefix + "post_attention_layernorm.weight": [hidden],
            }
        return shapes


_WRITE_WEIGHTS = """
import json, sys
import torch
from safetensors.torch import save_file
path, shapes, seed, dtype = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
generator = torch.Generator().manual_seed(seed)
tensors = {}
for name, shape in sorted(shapes.items()):
    if len(shape) == 1:
        value = torch.ones(shape)
    elif name == "model.embed_tokens.weight":
        value = torch.randn(shape, generator=generator)
    else:
        value = torch.randn(shape, generator=generator) / shape[1] ** 0.5
    tensors[name] = value.to(getattr(torch, dtype)).contiguous()
save_file(tensors, path)
"""


def prompt_ids(length: int, *, seed: int = 0, vocab: int = 1024) -> list[int]:
    """A deterministic prompt of `length` token ids, avoiding BOS/EOS (ids 1, 2) and 0."""
    return [3 + (seed * 7919 + i * 104729 + (i * i) % 97) % (vocab - 3) for i in range(length)]


# --------------------------------------------------------------------------------------------
# Ports, env, PYTHONPATH


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int) -> list[int]:
    """`count` distinct free TCP ports on 127.0.0.1, chosen below the kernel's ephemeral
    range (all sockets held until all are chosen). A server binds its port a minute later,
    after vLLM started; an ephemeral port freed meanwhile can be handed to any process's
    outgoing connection or `bind(0)` (vLLM's own ZMQ and gloo sockets are many), and once
    was: "Address already in use". The kernel hands out none below the range."""
    low = 10000
    high = max(low + count, _ephemeral_range()[0] - 1)
    rng = random.Random()
    with ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            port = rng.randint(low, high)
            if port in ports or port in _HANDED_OUT:  # not yet bound by whoever got it
                continue
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
        _HANDED_OUT.update(ports)
        return ports


def cpu_binding(tp: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `tp` CPU workers: this process's CPUs dealt out round
    robin, one list per rank ("0|1" on 2 cores). vLLM's "auto" binding puts each rank on its
    own NUMA node and refuses TP 2 on a one-node host."""
    cpus = sorted(os.sched_getaffinity(0))
    lists = [cpus[rank::tp] or cpus[rank % len(cpus):][:1] for rank in range(tp)]
    return "|".join(",".join(str(c) for c in cpu_list) for cpu_list in lists)


def role_core(role: str) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for a TP 1 engine of `role`: prefill on this process's
    first CPU, decode on its last, one OpenMP thread each, as each would have its own CPUs
    in a cluster. vLLM's "auto" gives every engine a thread on every core, and two engines'
    OpenMP threads spin-waiting on the same 2 cores delayed each P/D request by 0.4-1 s
    (16-token prompts: 0.8-1.1 s end to end shared, 36-143 ms split)."""
    cpus = sorted(os.sched_getaffinity(0))
    return str(cpus[0] if role == "prefill" else cpus[-1])


def server_pythonpath() -> str:
    """The checkout's package roots holding `pd_transfer` and `pd_contract` (from
    pyproject's `[tool.setuptools.packages.find] where`), joined for `PYTHONPATH`."""
    with (REPO / "pyproject.toml").open("rb") as handle:
        pyproject = tomllib.load(handle)
    roots = pyproject["tool"]["setuptools"]["packages"]["find"]["where"]
    wanted = ("pd_transfer", "pd_contract")
    found = [str(REPO / root) for root in roots
             if any((REPO / root / package).is_dir() for package in wanted)]
    if len(found) != len(wanted):
        raise RuntimeError(f"expected package roots for {wanted} in pyproject's where={roots}, "
                           f"found {found}")
    return os.pathsep.join(found)


def vllm_env_or_skip() -> VllmEnv:
    """The cached vLLM env, or skip the test (fail when `PD_OPERATOR_REQUIRE_VLLM` is set)."""
    env = find_vllm_env()
    if env is not None:
        return env
    reason = (f"vLLM virtualenv not built ({vllm_env_dir()} missing or incomplete); build it "
              "with `python -m pd_devcluster.vllm_env` (1-2 min, ~4 GB)")
    if os.environ.get(REQUIRE_VLLM_ENV):
        pytest.fail(f"{REQUIRE_VLLM_ENV} is set but {reason}", pytrace=False)
    pytest.skip(reason)


def _base_env() -> dict[str, str]:
    """This process's environment minus what would leak the test venv into vLLM's."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTEST_CURRENT_TEST")
    return {key: value for key, value in os.environ.items() if key not in drop}


# --------------------------------------------------------------------------------------------
# Servers


class ServerDied(RuntimeError):
    """A vLLM server exited or never became healthy; the message holds its log tail."""


class PdFailed(RuntimeError):
    """A P/D request came back incomplete (vLLM reports a failed KV pull that way)."""


@dataclass
class VllmServer:
    """One vLLM OpenAI-compatible server process.

    `role` names it in logs and errors ("single", "prefill", "decode"); `extra_args` are
    appended to the standard options (e.g. `--kv-transfer-config ...`); `env` is added to
    the base environment (`VLLM_CPU_KVCACHE_SPACE=1`, `PYTHONPATH=server_pythonpath()`).
    """

    role: str
    port: int
    vllm: VllmEnv
    model_dir: Path
    log_dir: Path
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    block_size: int = 32
    max_model_len: int = 2048
    max_num_batched_tokens: int = 256
    dtype: str = "bfloat16"
    # Off by default: a repeated prompt would be served from the prefix cache (and a decode
    # instance would skip the KV pull), which hides what the tests and benchmarks measure.
    prefix_caching: bool = False
    # safetensors: the seeded checkpoint `ModelSpec.write` makes (the same weights at any
    # TP); dummy: vLLM's own random weights (one config.json is enough; same TP only).
    load_format: str = "safetensors"
    ready_timeout_s: float = 300.0
    process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    started_s: float | None = field(default=None, init=False)
    ready_after_s: float | None = field(default=None, init=False)

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"vllm-{self.role}-{self.port}.log"

    @property
    def host(self) -> str:
        return "127.0.0.1"

    def argv(self) -> list[str]:
        return [
            *self.vllm.api_server_argv(),
            "--model", str(self.model_dir),
            "--served-model-name", SERVED_MODEL_NAME,
            "--load-format", self.load_format,
            "--seed", "0",
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--block-size", str(self.block_size),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--host", self.host,
            "--port", str(self.port),
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
            *self.extra_args,
        ]

    def full_env(self) -> dict[str, str]:
        return {
            **_base_env(),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "PYTHONPATH": server_pythonpath(),
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }

    def launch(self) -> None:
        """Spawn the process (its own session/process group) without waiting for it."""
        if self.process is not None:
            raise RuntimeError(f"vLLM {self.role} already launched")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(self.argv())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(self.argv(), env=self.full_env(), stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        # Behind the control plane and the test's own processes, as the dev kubelet runs
        # engines; set before the server starts its engine processes, which inherit it.
        with suppress(ProcessLookupError):  # exited at once: wait_ready reports it
            os.setpriority(os.PRIO_PROCESS, self.process.pid, ENGINE_NICENESS)
        self.started_s = time.monotonic()

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Poll `/health` until 200; return seconds since launch. Raise `ServerDied` with the
        log tail if the process exits or the timeout passes."""
        if self.process is None or self.started_s is None:
            raise RuntimeError(f"vLLM {self.role} not launched")
        deadline = self.started_s + (timeout_s if timeout_s is not None else self.ready_timeout_s)
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerDied(f"vLLM {self.role} (port {self.port}) exited with code {code} "
                                 f"before it was healthy. Log {self.log_path}:\n{self.log_tail()}")
            if self._healthy():
                self.ready_after_s = time.monotonic() - self.started_s
                return self.ready_after_s
            if time.monotonic() > deadline:
                raise ServerDied(f"vLLM {self.role} (port {self.port}) not healthy after "
                                 f"{time.monotonic() - self.started_s:.0f} s. Log "
                                 f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    def start(self, timeout_s: float | None = None) -> float:
        """Launch and wait until healthy; return the startup seconds."""
        self.launch()
        try:
            return self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _healthy(self) -> bool:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=2)
        try:
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the server's process group (API server + engine core), SIGKILL after
        `grace_s`. Idempotent."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace_s)
        # The group may hold children (EngineCore) even after the leader exited.
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)

    def freeze(self) -> None:
        """SIGSTOP the server's process group (a hung pod: sockets open, nothing answers)."""
        if self.process is not None:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL the server's process group at once (a pod that dies without cleanup)."""
        process = self.process
        if process is None:
            return
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def log_lines_naming(self, text: str, lines: int = 8) -> str:
        """The last `lines` lines of the log that contain `text` (a room, a request id)."""
        found = [line for line in self.log_text().splitlines() if text in line]
        return "\n".join(found[-lines:]) or f"(no line of {self.log_path.name} names {text})"

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def start_servers(servers: Sequence[VllmServer],
                  timeout_s: float | None = None) -> dict[str, float]:
    """Launch all, then wait for all (in parallel); on any failure stop every one and raise.
    Returns role -> startup seconds."""
    try:
        for server in servers:
            server.launch()
        with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
            futures = [pool.submit(server.wait_ready, timeout_s) for server in servers]
            return {server.role: future.result() for server, future in zip(servers, futures,
                                                                             strict=True)}
    except BaseException:
        for server in servers:
            server.stop()
        raise


@contextmanager
def running(servers: Sequence[VllmServer], timeout_s: float | None = None) -> Iterator[
        dict[str, float]]:
    """`start_servers`, then stop them all on exit."""
    startup = start_servers(servers, timeout_s)
    try:
        yield startup
    finally:
        for server in servers:
            server.stop()


# --------------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True)
class CompletionResult:
    """One completion: generated token ids, the `kv_transfer_params` the server returned
    (non-streaming only), TTFT (streaming only: request sent -> first token received) and
    the whole request's latency."""

    token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    ttft_s: float | None
    latency_s: float
    finish_reason: str | None = None
    # Per generated token, its `top_logprobs` most likely tokens' logprobs (asked for only).
    top_logprobs: list[dict[int, float]] | None = None


# One bf16 step of the tiny models' logits (|logit| < 8 here): two tokens whose logprobs
# are this close are tied up to rounding, and which one greedy picks depends on the
# accumulation order of vLLM's CPU kernels, i.e. on which requests share the batch.
# Measured: a prompt whose reference had an exact tie at its 7th token got the runner-up
# from a single vLLM server with 3 other requests in flight.
TIE_LOGPROB_GAP = 1 / 64


def greedy_disagreement(reference: CompletionResult, got: Sequence[int]) -> str | None:
    """Why `got` is not what greedy decoding gives for `reference`'s prompt, or None.

    Identical tokens agree. So does a first difference where the reference's top two
    tokens are tied (within `TIE_LOGPROB_GAP`) and `got` took the other one: from there the
    two continuations are different prompts, so nothing after it is compared. Any other
    difference is a disagreement. `reference` must carry `top_logprobs` (>= 2)."""
    assert reference.top_logprobs is not None, "the reference needs top_logprobs"
    for step, (want, have) in enumerate(zip(reference.token_ids, got, strict=True)):
        if want == have:
            continue
        ranked = sorted(reference.top_logprobs[step].items(), key=lambda kv: -kv[1])
        tied = {token for token, logprob in ranked if ranked[0][1] - logprob <= TIE_LOGPROB_GAP}
        if have in tied:
            return None
        return (f"token {step}: {have} where greedy gives {want} (top logprobs "
                f"{dict(ranked)}; got {list(got)}, expected {reference.token_ids})")
    return None


def _request_body(prompt: Sequence[int], max_tokens: int, *, stream: bool,
                  kv_transfer_params: Mapping[str, Any] | None,
                  top_logprobs: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SERVED_MODEL_NAME,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        # Exactly `max_tokens` tokens even if the dummy model emits EOS (id 2).
        "ignore_eos": True,
        # vLLM >= 0.10: `choices[i].token_ids` (the delta in streaming chunks). The servers
        # run with --skip-tokenizer-init, so `text` is "".
        "return_token_ids": True,
        "stream": stream,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    if top_logprobs:
        # Named "token_id:<id>": without a tokenizer vLLM cannot name them otherwise.
        body["logprobs"] = top_logprobs
        body["return_tokens_as_token_ids"] = True
    return body


def _top_logprobs(choice: Mapping[str, Any]) -> list[dict[int, float]] | None:
    logprobs = choice.get("logprobs")
    if not logprobs:
        return None
    return [{int(name.removeprefix("token_id:")): float(value) for name, value in step.items()}
            for step in logprobs["top_logprobs"]]


class Server(Protocol):
    """What `complete` needs of a server: a vLLM server or a router in front of several."""

    @property
    def role(self) -> str: ...

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


@dataclass(frozen=True)
class HttpTarget:
    """A server known only by its address (a router)."""

    role: str
    host: str
    port: int


def complete(server: Server, prompt: Sequence[int], max_tokens: int,
             kv_transfer_params: Mapping[str, Any] | None = None, *, stream: bool = False,
             timeout_s: float = 120.0, top_logprobs: int = 0) -> CompletionResult:
    """POST /v1/completions with token ids; greedy. See `CompletionResult`.
    `top_logprobs`: ask for that many most likely tokens per generated token."""
    body = json.dumps(_request_body(prompt, max_tokens, stream=stream,
                                    kv_transfer_params=kv_transfer_params,
                                    top_logprobs=top_logprobs)).encode()
    connection = http.client.HTTPConnection(server.host, server.port, timeout=timeout_s)
    try:
        connection.connect()
        started = time.perf_counter()
        connection.request("POST", "/v1/completions", body=body,
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            detail = response.read().decode(errors="replace")
            raise RuntimeError(f"vLLM {server.role} answered {response.status}: {detail[:2000]}")
        if not stream:
            payload = json.loads(response.read())
            latency = time.perf_counter() - started
            choice = payload["choices"][0]
            return CompletionResult(token_ids=list(choice.get("token_ids") or []),
                                    kv_transfer_params=payload.get("kv_transfer_params"),
                                    ttft_s=None, latency_s=latency,
                                    finish_reason=choice.get("finish_reason"),
                                    top_logprobs=_top_logprobs(choice))
        return _read_stream(response, started)
    finally:
        connection.close()


def _read_stream(response: http.client.HTTPResponse, started: float) -> CompletionResult:
    token_ids: list[int] = []
    ttft: float | None = None
    finish_reason: str | None = None
    kv_params: dict[str, Any] | None = None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("error"):
            raise RuntimeError(f"vLLM streamed an error: {chunk['error']}")
        if chunk.get("kv_transfer_params"):
            kv_params = chunk["kv_transfer_params"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("token_ids") or []
            if delta and ttft is None:
                ttft = time.perf_counter() - started
            token_ids.extend(delta)
            finish_reason = choice.get("finish_reason") or finish_reason
    latency = time.perf_counter() - started
    return CompletionResult(token_ids=token_ids, kv_transfer_params=kv_params, ttft_s=ttft,
                            latency_s=latency, finish_reason=finish_reason)


# --------------------------------------------------------------------------------------------
# vLLM's NixlConnector as the P/D baseline


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


# --------------------------------------------------------------------------------------------
# Our PDTransferConnector

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


def metrics_text(address: str, timeout_s: float = 5.0) -> str:
    """`GET http://address/metrics`: the exposition text."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("GET", "/metrics")
        return connection.getresponse().read().decode()
    finally:
        connection.close()


def scrape_sum(address: str, name: str) -> float:
    """The sum of every `name` sample at `http://address/metrics`, whatever its labels."""
    return sum(float(sample.value)
               for family in text_string_to_metric_families(metrics_text(address))
               for sample in family.samples if sample.name == name)


def scrape(address: str, name: str, **labels: str) -> float | None:
    """The value of the sample `name{labels}` at `http://address/metrics` (labels must match
    exactly), None when there is no such sample."""
    for family in text_string_to_metric_families(metrics_text(address)):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def vllm_metric(server: VllmServer, name: str) -> float:
    """A vLLM engine metric (`vllm:...`, engine 0) from the server's `/metrics`."""
    value = scrape(f"{server.host}:{server.port}", name, engine="0",
                   model_name=SERVED_MODEL_NAME)
    if value is None:
        raise AssertionError(f"vLLM {server.role} exports no {name}")
    return value


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
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp)]
        bind = {"VLLM_CPU_OMP_THREADS_BIND": cpu_binding(tp)}
    else:
        bind = {"VLLM_CPU_OMP_THREADS_BIND": role_core(role)}
    server = VllmServer(role=name, port=port, vllm=vllm, model_dir=model_dir, log_dir=root,
                        extra_args=args, env={"UCX_NET_DEVICES": "lo", **bind, **(env or {})},
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
