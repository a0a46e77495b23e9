"""A real local Kubernetes control plane for development and integration tests.

Reading order: `paths` (where things live) -> `toolchain` (building/fetching the binaries
once) -> `pki`, `kubeconfig`, `components` (pure-ish inputs) -> `processes` (daemons
started and stopped by identity) -> `cluster` (up/down orchestration) -> `cli`.
"""

from pd_operator.devcluster import cli
from pd_operator.devcluster.cluster import (
    ControlPlaneHandle,
    apply_crds,
    load_handle,
    service_account_kubeconfig,
    start_control_plane,
    stop_control_plane,
)
from pd_operator.devcluster.components import Ports
from pd_operator.devcluster.errors import DevClusterError, ToolchainMissingError
from pd_operator.devcluster.paths import cache_dir, default_state_dir
from pd_operator.devcluster.toolchain import (
    Toolchain,
    checkov_path,
    ensure_checkov,
    ensure_toolchain,
    find_toolchain,
    helm_path,
)

__all__ = [
    "ControlPlaneHandle",
    "DevClusterError",
    "Ports",
    "Toolchain",
    "ToolchainMissingError",
    "apply_crds",
    "cache_dir",
    "checkov_path",
    "cli",
    "default_state_dir",
    "ensure_checkov",
    "ensure_toolchain",
    "find_toolchain",
    "helm_path",
    "load_handle",
    "service_account_kubeconfig",
    "start_control_plane",
    "stop_control_plane",
]
