"""`pd-dev demo`: argparse wiring for the one-command local demo (dev tooling)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pd_devcluster.demo import run_demo
from pd_devcluster.errors import DevClusterError
from pd_devcluster.paths import default_state_dir

__all__ = ["add_parser"]


def _run(args: argparse.Namespace) -> int:
    try:
        return run_demo(args.state_dir, args.examples, args.namespace, args.timeout)
    except DevClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the operator on a local control plane with the example PDDeployments",
        description="Development tooling, not part of the product: builds (once) and starts "
        "a local kube-apiserver + etcd + kube-controller-manager, runs the operator against "
        "it, applies the example PDDeployments and shows what the operator made of them.",
    )
    parser.add_argument("--examples", type=Path, default=Path("examples"),
                        help="directory of PDDeployment manifests (default: %(default)s)")
    parser.add_argument("--namespace", default="pd-demo",
                        help="namespace to apply them into (default: %(default)s)")
    parser.add_argument("--state-dir", type=Path, default=default_state_dir(),
                        help="dev-cluster state directory (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for the operator's status (default: %(default)s)")
    parser.set_defaults(handler=_run)
