"""What a vLLM server process is given: free ports, CPUs to bind to, the checkout's package
roots on `PYTHONPATH`, and the cached vLLM virtualenv (or a skipped test without one).

- `free_ports` hands out ports below the kernel's ephemeral range, never the same twice.
- `cpu_binding` / `role_core`: `VLLM_CPU_OMP_THREADS_BIND` for TP ranks or one role's engine.
- `server_pythonpath` puts the checkout's `transfer/` and `contract/` package roots on the
  servers' `PYTHONPATH`, so `kv_connector_module_path="pd_transfer.vllm.connector"` imports
  the connector from this checkout.
- `vllm_env_or_skip` finds the vLLM env for a test: skip when it is missing, unless
  `PD_OPERATOR_REQUIRE_VLLM` is set (CI), then fail.
"""

from __future__ import annotations

import os
import random
import socket
import tomllib
from contextlib import ExitStack
from pathlib import Path

import pytest

from pd_devcluster.vllm_env import VllmEnv, find_vllm_env, vllm_env_dir
from pd_testbed.checkout import REPO_ROOT

__all__ = ["REQUIRE_VLLM_ENV", "base_env", "cpu_binding", "free_ports", "role_core",
           "server_pythonpath", "vllm_env_or_skip"]

REQUIRE_VLLM_ENV = "PD_OPERATOR_REQUIRE_VLLM"

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
    (16-token prompts: 0.8-1.1 s end to end shared, 36-143 ms split). vLLM binds only in
    its multiprocess executor (a worker process per rank); a TP-1 engine whose model runs in
    its engine-core process (`VllmServer.worker_process` False) keeps one unbound thread."""
    cpus = sorted(os.sched_getaffinity(0))
    return str(cpus[0] if role == "prefill" else cpus[-1])


def server_pythonpath() -> str:
    """The checkout's package roots holding `pd_transfer` and `pd_contract` (from
    pyproject's `[tool.setuptools.packages.find] where`), joined for `PYTHONPATH`."""
    with (REPO_ROOT / "pyproject.toml").open("rb") as handle:
        pyproject = tomllib.load(handle)
    roots = pyproject["tool"]["setuptools"]["packages"]["find"]["where"]
    wanted = ("pd_transfer", "pd_contract")
    found = [str(REPO_ROOT / root) for root in roots
             if any((REPO_ROOT / root / package).is_dir() for package in wanted)]
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


def base_env() -> dict[str, str]:
    """This process's environment minus what would leak the test venv into vLLM's."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTEST_CURRENT_TEST")
    return {key: value for key, value in os.environ.items() if key not in drop}
