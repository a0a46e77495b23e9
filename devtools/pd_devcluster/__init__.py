"""Development tooling, not the product: a real local Kubernetes control plane for
development and integration tests, a fake kubelet, the toolchain and vLLM-environment
builders, and the one-command demo (the `pd-dev` command). Neither the operator's nor the
engines' images ship it.

Reading order: `paths` (where things live) -> `toolchain` (building/fetching the binaries
once) -> `pki`, `kubeconfig`, `components` (pure-ish inputs) -> `processes` (daemons
started and stopped by identity) -> `cluster` (up/down orchestration) -> `kubelet` ->
`demo` -> `cluster_cli`, `demo_cli` -> `cli`.
"""

from pd_devcluster.cluster import (
    ControlPlaneHandle,
    apply_crds,
    load_handle,
    restart_apiserver,
    service_account_kubeconfig,
    start_control_plane,
    stop_control_plane,
)
from pd_devcluster.components import Ports
from pd_devcluster.errors import DevClusterError, ToolchainMissingError
from pd_devcluster.paths import cache_dir, default_state_dir
from pd_devcluster.toolchain import (
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
    "default_state_dir",
    "ensure_checkov",
    "ensure_toolchain",
    "find_toolchain",
    "helm_path",
    "load_handle",
    "restart_apiserver",
    "service_account_kubeconfig",
    "start_control_plane",
    "stop_control_plane",
]
