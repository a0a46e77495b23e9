"""`pd-operator crds`: print, write or check the CRDs generated from the API models."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pd_operator.api import crd


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "crds",
        help="print the CRDs generated from the API models",
        description="Print the CustomResourceDefinitions generated from the pydantic models "
        "(multi-document YAML), write them into a directory, or check that a directory "
        "holds exactly what the models generate.",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--write", metavar="DIR", type=Path, help="write one file per CRD into DIR"
    )
    group.add_argument(
        "--check",
        metavar="DIR",
        type=Path,
        nargs="?",
        const=Path("crds"),
        help="exit 1 with a diff when DIR (default: crds) is out of sync with the models",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.write is not None:
        for path in crd.write(args.write):
            print(f"wrote {path}")
        return 0
    if args.check is not None:
        if not args.check.is_dir():
            print(f"error: {args.check} is not a directory", file=sys.stderr)
            return 2
        delta = crd.diff(args.check)
        if delta:
            sys.stdout.write(delta)
            print(
                f"\n{args.check} is out of sync with the API models; regenerate with "
                f"`pd-operator crds --write {args.check}`",
                file=sys.stderr,
            )
            return 1
        print(f"{args.check} is in sync with the API models")
        return 0
    sys.stdout.write("---\n".join(crd.render(c) for c in crd.all_crds()))
    return 0
