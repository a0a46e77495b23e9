"""The `pd-dev` command: development tooling, not the product.

    pd-dev cluster <build|tools|up|down|env|status|kubelet>   the local control plane
    pd-dev demo                                               the whole product on this machine

Each sub-command sets `handler=<callable(args) -> int>`; its exit code is the command's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pd_devcluster import cluster_cli, demo_cli

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-dev",
        description="Development tooling of pd-operator (not part of the product): a local "
                    "Kubernetes control plane, a fake kubelet and the one-command demo.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    cluster_cli.add_parser(subparsers)
    demo_cli.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
