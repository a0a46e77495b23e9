"""Where the dev cluster keeps its toolchain (cache) and its running state.

Both live outside the repository on purpose: the toolchain is ~250 MB of binaries built
once per machine, and the state dir holds keys, logs and etcd data of a running cluster.

- cache: `$PD_OPERATOR_CACHE`, else `~/.cache/pd-operator`
- state: `$PD_OPERATOR_STATE/dev-cluster`, else `~/.local/state/pd-operator/dev-cluster`
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["bin_dir", "cache_dir", "default_state_dir", "logs_dir"]

CACHE_ENV = "PD_OPERATOR_CACHE"
STATE_ENV = "PD_OPERATOR_STATE"


def cache_dir() -> Path:
    """Root of the toolchain cache (not created here)."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser().resolve()
    return Path.home() / ".cache" / "pd-operator"


def bin_dir() -> Path:
    """Directory holding kube-apiserver, kube-controller-manager, etcd and helm."""
    return cache_dir() / "bin"


def logs_dir() -> Path:
    """Directory holding build logs (make, apt) for post-mortems."""
    return cache_dir() / "logs"


def default_state_dir() -> Path:
    """State dir of the CLI's dev cluster: pki, kubeconfigs, logs, pids, etcd data."""
    configured = os.environ.get(STATE_ENV)
    base = (
        Path(configured).expanduser().resolve()
        if configured
        else Path.home() / ".local" / "state" / "pd-operator"
    )
    return base / "dev-cluster"
