"""Command line of the operator: `pd-operator <command>`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pd_operator import crds_cli, operator_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-operator",
        description="Kubernetes operator for prefill/decode disaggregated LLM serving.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    crds_cli.add_parser(subparsers)
    operator_cli.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = args.handler
    return int(handler(args))


if __name__ == "__main__":
    sys.exit(main())
