"""Each side imports without the other: the in-pod side without kopf and the operator, the
operator without torch and NIXL (`pd_contract` is all they share); neither needs the
development tooling (devtools/), which itself needs neither torch, NIXL nor the in-pod side."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# The development tooling's packages (devtools/): no image has them.
DEVTOOLS = ["pd_devcluster", "pd_testbed"]

# Runs in a fresh interpreter: a meta-path finder placed first refuses the named top-level
# packages (as if they were not installed), then every module of the packages is imported
# (but `__main__`, which would run the command line). A module that needs an optional
# dependency that is absent here (`OPTIONAL`) is skipped: `staging_kernel` needs Triton,
# which only CUDA images have (`staging` falls back to torch without it), and
# `vllm.connector` needs vLLM, which only vLLM engine images have (the project's tests run
# it inside the cached vLLM virtualenv).
_PROBE = textwrap.dedent(
    """
    import importlib, importlib.abc, pkgutil, sys

    REFUSED = set(sys.argv[1].split(","))
    PACKAGES = sys.argv[2].split(",")
    OPTIONAL = {"triton", "vllm"}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in REFUSED:
                raise ModuleNotFoundError(f"refused: {name}", name=name)
            return None

    sys.meta_path.insert(0, Refuse())
    for name in list(sys.modules):
        if name.split(".")[0] in REFUSED:
            del sys.modules[name]

    imported = []
    for package in PACKAGES:
        root = importlib.import_module(package)
        imported.append(package)
        for info in pkgutil.walk_packages(root.__path__, prefix=package + "."):
            if info.name.endswith(".__main__"):
                continue
            try:
                importlib.import_module(info.name)
            except ModuleNotFoundError as exc:
                if (exc.name or "").split(".")[0] not in OPTIONAL:
                    raise
                continue
            imported.append(info.name)
    leaked = sorted(n for n in sys.modules if n.split(".")[0] in REFUSED)
    assert not leaked, leaked
    print("\\n".join(imported))
    """
)


def _import_all(refused: list[str], packages: list[str]) -> list[str]:
    """Names of every module imported, or a test failure with the child's traceback."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(refused), ",".join(packages)],
        capture_output=True, text=True, timeout=240, check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"importing {packages} without {refused} failed:\n{proc.stderr}")
    return proc.stdout.split()


def test_in_pod_side_imports_without_kopf_the_operator_or_the_dev_tooling() -> None:
    modules = _import_all(["kopf", "pd_operator", *DEVTOOLS], ["pd_contract", "pd_transfer"])
    # The walk really reached the agent, the engine and the contract's models.
    for name in ("pd_contract.config", "pd_contract.transferagent", "pd_transfer.agent.reporter",
                 "pd_transfer.reference.engine.service", "pd_transfer.transport.nixl"):
        assert name in modules


def test_operator_imports_without_torch_nixl_or_the_dev_tooling() -> None:
    """Guards against the operator image lacking a module the operator imports: the
    development tooling once lived in the operator package and its CLI."""
    modules = _import_all(["torch", "nixl", "pd_transfer", *DEVTOOLS],
                          ["pd_contract", "pd_operator"])
    for name in ("pd_operator.handlers", "pd_operator.build.config", "pd_operator.engines.vllm",
                 "pd_operator.cli"):
        assert name in modules


def test_dev_tooling_imports_without_torch_nixl_or_the_in_pod_side() -> None:
    """`pd-dev` runs the engines and the agents as processes; it imports none of them."""
    modules = _import_all(["torch", "nixl", "pd_transfer"], ["pd_devcluster"])
    for name in ("pd_devcluster.cli", "pd_devcluster.demo", "pd_devcluster.kubelet",
                 "pd_devcluster.vllm_env"):
        assert name in modules
