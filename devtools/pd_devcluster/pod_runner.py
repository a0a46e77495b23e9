"""DEV TOOLING: how the fake kubelet runs a pod's container as a local process (pure).

The dev cluster has no container runtime, so the fake kubelet (`kubelet.py`) knows a few
container commands and runs each with a local interpreter:

- `pd-transfer <subcommand> ...` (the reference engine, the router, the native agent): this
  interpreter, `python -m pd_transfer.cli <subcommand> ...`;
- `python3 -m vllm.entrypoints.openai.api_server ...`: the cached vLLM virtualenv's
  interpreter (`vllm_env.py`), with the checkout's `pd_transfer` and `pd_contract` on its
  `PYTHONPATH` (the image would have them installed), so `PDTransferConnector` loads.

Every pod shares the host's network here, each on its own loopback address: a server told
to listen on `0.0.0.0` would take its port on every pod's address, so listening addresses
are narrowed to the pod's (`--host` of the router, `--metrics-host` of the transfer-agent
sidecar, given when the command has none, and the connector's `bind_host` in vLLM's
`--kv-transfer-config`), and a URL to the pod's own loopback (`http://127.0.0.1:…`, how a
sidecar reaches its engine) points at the pod's address. Any other command is not runnable:
its pod stays Pending, as it would on a node without the image.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Final

__all__ = [
    "VLLM_SERVER_MODULE",
    "LaunchPlan",
    "NotRunnable",
    "Probe",
    "missing_resources",
    "package_roots",
    "plan_launch",
]

PD_TRANSFER: Final = "pd-transfer"
VLLM_SERVER_MODULE: Final = "vllm.entrypoints.openai.api_server"
_KV_CONFIG_FLAG: Final = "--kv-transfer-config"
_LOOPBACK: Final = re.compile(r"//(?:127\.0\.0\.1|localhost):")
# pd-transfer subcommands that listen on all addresses unless told (the reference engine
# binds its pod IP), and the flag that tells them.
_LISTEN_FLAG: Final = {"router": "--host", "vllm-proxy": "--host", "agent": "--metrics-host"}


class NotRunnable(ValueError):
    """The container's command is not one the fake kubelet knows how to run."""


@dataclass(frozen=True)
class Probe:
    """A container probe as the fake kubelet checks it: an HTTP GET (2xx/3xx passes) or a
    TCP connect on the pod's address."""

    port: int
    http_path: str | None = None  # None: a TCP connect


@dataclass(frozen=True)
class LaunchPlan:
    """What to run for one container: argv, extra environment, and its readiness probe."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    readiness: Probe | None = None  # None: ready while the process runs


def package_roots(*packages: str) -> list[str]:
    """The directories holding the importable `packages` (for a PYTHONPATH), found without
    importing them."""
    roots: list[str] = []
    for package in packages:
        spec = find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise NotRunnable(f"package {package!r} is not importable here")
        root = str(Path(next(iter(spec.submodule_search_locations))).parent)
        if root not in roots:
            roots.append(root)
    return roots


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for p in container.get("ports") or []
            if "name" in p}


def _probe(container: dict[str, Any]) -> Probe | None:
    probe = container.get("readinessProbe")
    if not probe:
        return None
    named = _ports(container)

    def port_of(value: object) -> int:
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value in named:
            return named[value]
        raise NotRunnable(f"readiness probe port {value!r} is neither a number nor a named "
                          f"container port ({sorted(named)})")

    if "httpGet" in probe:
        return Probe(port_of(probe["httpGet"]["port"]), str(probe["httpGet"].get("path", "/")))
    if "tcpSocket" in probe:
        return Probe(port_of(probe["tcpSocket"]["port"]))
    raise NotRunnable(f"readiness probe {sorted(probe)} is not supported (httpGet, tcpSocket)")


def _narrow_host(args: list[str], ip: str, host_flag: str = "--host") -> list[str]:
    out = list(args)
    for index, (flag, _) in enumerate(itertools.pairwise(out)):
        if flag == host_flag:
            out[index + 1] = ip
    return out


def _narrow_connector(args: list[str], ip: str) -> list[str]:
    """PDTransferConnector's listening address (bootstrap, metrics) → the pod's address."""
    out = list(args)
    for index, (flag, value) in enumerate(itertools.pairwise(out)):
        if flag != _KV_CONFIG_FLAG:
            continue
        config = json.loads(value)
        if config.get("kv_connector") == "PDTransferConnector":
            extra = dict(config.get("kv_connector_extra_config") or {})
            extra["bind_host"] = ip
            config["kv_connector_extra_config"] = extra
            out[index + 1] = json.dumps(config, separators=(",", ":"))
    return out


# What this node offers; anything else (nvidia.com/gpu, rdma/ib, ...) it does not have.
_NODE_RESOURCES: Final = ("cpu", "memory", "ephemeral-storage")


def missing_resources(pod: dict[str, Any], offered: Collection[str] = ()) -> list[str]:
    """Extended resources `pod` requests or limits that this node does not offer (GPUs,
    RDMA devices; `offered`: those it pretends to have): a scheduler leaves such a pod
    Pending, and so does the fake kubelet."""
    names: set[str] = set()
    spec = pod.get("spec") or {}
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        resources = container.get("resources") or {}
        for section in ("requests", "limits"):
            names.update(name for name, value in (resources.get(section) or {}).items()
                         if name not in _NODE_RESOURCES and name not in offered
                         and not name.startswith("hugepages-") and str(value) not in ("0", ""))
    return sorted(names)


def plan_launch(command: Sequence[str], container: dict[str, Any], ip: str, *,
                vllm_python: Callable[[], Path]) -> LaunchPlan:
    """The local process for `command` (the container's command and args, mount paths
    already rewritten) of a pod at `ip`; raises NotRunnable. `vllm_python` finds (or
    refuses, with NotRunnable) the vLLM env's interpreter, only when a vLLM pod asks."""
    args = list(command)
    readiness = _probe(container)
    # Containers of one pod share its network: their loopback is the pod's address here.
    args = [_LOOPBACK.sub(f"//{ip}:", arg) for arg in args]
    if args[:1] == [PD_TRANSFER] and len(args) > 1:
        flag = _LISTEN_FLAG.get(args[1])
        if flag is not None and flag not in args:
            args += [flag, ip]  # its default, 0.0.0.0, would take the port on every pod
        return LaunchPlan([sys.executable, "-m", "pd_transfer.cli",
                           *_narrow_host(args[1:], ip, flag or "--host")], readiness=readiness)
    if len(args) >= 3 and Path(args[0]).name.startswith("python") and args[1:3] == [
            "-m", VLLM_SERVER_MODULE]:
        roots = package_roots("pd_transfer", "pd_contract")
        return LaunchPlan(
            [str(vllm_python()), *_narrow_connector(_narrow_host(args[1:], ip), ip)],
            env={"PYTHONPATH": os.pathsep.join(roots), "PYTHONUNBUFFERED": "1"},
            readiness=readiness)
    raise NotRunnable(f"the fake kubelet runs `pd-transfer ...` and vLLM's OpenAI server "
                      f"only, not {' '.join(args[:3])!r}")
