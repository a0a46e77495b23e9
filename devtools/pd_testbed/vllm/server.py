"""One vLLM OpenAI-compatible server process (CPU backend) and starting several at once.

`VllmServer` starts `python -m vllm.entrypoints.openai.api_server` from the cached vLLM
virtualenv (`pd_devcluster.vllm_env`) in its own process group, at the dev
kubelet's engine niceness, waits for `/health`, and stops it (SIGTERM, then SIGKILL); it can
also freeze (SIGSTOP) or kill it as a fault, and read its log (the tail, the lines naming a
room). `start_servers` / `running` start several at once (vLLM's ~90 s startup is mostly
CPU-light waiting, so parallel startup pays).
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from pd_devcluster.kubelet import ENGINE_NICENESS
from pd_devcluster.vllm_env import VllmEnv
from pd_testbed.vllm.environment import base_env, server_pythonpath
from pd_testbed.vllm.model import SERVED_MODEL_NAME

__all__ = ["ServedModel", "ServerDied", "VllmServer", "running", "start_servers"]

_LOG_TAIL_LINES = 60


class ServerDied(RuntimeError):
    """A vLLM server exited or never became healthy; the message holds its log tail."""


@dataclass
class VllmServer:
    """One vLLM OpenAI-compatible server process.

    `role` names it in logs and errors ("single", "prefill", "decode"); `extra_args` are
    appended to the standard options (e.g. `--kv-transfer-config ...`); `env` is added to
    the base environment (`VLLM_CPU_KVCACHE_SPACE=1`, `PYTHONPATH=server_pythonpath()`).

    At `tensor_parallel` 1 the model runs in the engine-core process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), as vLLM runs a TP-1 engine on a GPU; vLLM's CPU
    backend by default (`worker_process=True`) starts a worker process even for one rank:
    one Python interpreter and vLLM import more, 50 s to ready instead of 35 s on one of 2
    idle cores. Larger TP runs vLLM's multiprocess executor, a worker process per rank.
    """

    role: str
    port: int
    vllm: VllmEnv
    model_dir: Path
    log_dir: Path
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    tensor_parallel: int = 1
    worker_process: bool = False
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
            *(["--tensor-parallel-size", str(self.tensor_parallel)]
              if self.tensor_parallel > 1 else []),
            *self.extra_args,
        ]

    def full_env(self) -> dict[str, str]:
        return {
            **base_env(),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "PYTHONPATH": server_pythonpath(),
            "PYTHONUNBUFFERED": "1",
            **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
               if self.tensor_parallel == 1 and not self.worker_process else {}),
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


@dataclass(frozen=True)
class ServedModel:
    """A model written once and a plain vLLM serving it (running): the reference
    completions of every test of that model in a session (tests/e2e/conftest.py)."""

    vllm: VllmEnv
    model_dir: Path
    single: VllmServer
