"""``pd-transfer``: command-line entry point of the in-pod transfer module.

Subcommands register themselves with an ``add_*_parser(subparsers)`` function that sets
``handler`` (``selftest``, ``bench``, ``engine``, ``load``, ``router``, ``vllm-proxy``,
``agent``, ``drain``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

# The one product module that imports the benchmarks (pd_transfer.bench) and the reference
# tooling (pd_transfer.reference), for their subcommands: an import-linter contract keeps
# every other product module from importing them.
from pd_transfer.bench.cli import add_bench_parser
from pd_transfer.drain import add_drain_parser
from pd_transfer.native.cli import add_agent_parser
from pd_transfer.reference.engine.cli import add_engine_parser
from pd_transfer.reference.load import add_load_parser
from pd_transfer.router.cli import add_router_parser, add_vllm_proxy_parser

__all__ = ["add_selftest_parser", "main"]


def add_selftest_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "selftest",
        help="transfer KV between a prefill and a decode group on this machine; verify bytes",
        description="Spawn PP x TP prefill ranks and TP decode ranks (one NIXL agent each), "
        "transfer requests with random non-contiguous pages and check every decode page "
        "bit-exactly. Exits 1 on any failure or mismatch.",
    )
    add = parser.add_argument
    add("--prefill-tp", type=int, default=2)
    add("--decode-tp", type=int, default=4)
    add("--prefill-pp", type=int, default=1)
    add("--layers", type=int, default=4)
    add("--kv-heads", type=int, default=4)
    add("--head-dim", type=int, default=64)
    add("--page-size", type=int, default=16)
    add("--tokens", type=int, default=1000, help="tokens per request")
    add("--dtype", choices=["bfloat16", "float16", "float32", "fp8_e4m3"], default="bfloat16")
    add("--mode", choices=["staged", "sliced", "contiguous", "auto"], default="auto")
    add("--requests", type=int, default=8)
    add("--concurrency", type=int, default=4, help="requests in flight per wave")
    add("--device", choices=["cpu", "cuda"], default="cpu")
    add("--decode-pool-mib", type=int, default=64)
    add("--prefill-buffer-mib", type=int, default=64)
    add("--timeout-seconds", type=float, default=60.0)
    add("--seed", type=int, default=0)
    add("--page-format", choices=["nhd", "hnd"], default="nhd",
        help="page format of the KV pools (hnd: head-major, a per-layer pool)")
    add("--packing", choices=["separate", "per_head"], default="separate",
        help="per_head: one KV part per layer, K then V rows per head (vLLM CPU; needs hnd)")
    add("--per-layer", action="store_true",
        help="vLLM-shaped per-layer tensors instead of stacked K/V tensors")
    add("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=_run_selftest)


def _run_selftest(args: argparse.Namespace) -> int:
    # Imported here, not at the top: parsing arguments (and --help) must not load torch/NIXL.
    from pd_transfer.errors import PlanError  # noqa: PLC0415
    from pd_transfer.reference.selftest import (  # noqa: PLC0415
        SelftestConfig,
        check_selftest_config,
        run_selftest,
    )

    config = SelftestConfig(
        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, prefill_pp=args.prefill_pp,
        layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
        page_size=args.page_size, tokens=args.tokens, dtype=args.dtype, mode=args.mode,
        requests=args.requests, concurrency=args.concurrency, device=args.device,
        decode_pool_mib=args.decode_pool_mib, prefill_buffer_mib=args.prefill_buffer_mib,
        timeout_s=args.timeout_seconds, seed=args.seed, page_format=args.page_format,
        packing=args.packing, per_layer=args.per_layer,
    )
    try:
        check_selftest_config(config)
        report = run_selftest(config)
    except (PlanError, ValueError) as exc:
        print(f"pd-transfer selftest: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{config.prefill_pp}x{config.prefill_tp} -> {config.decode_tp} {config.mode} "
            f"{config.dtype}: {config.requests} x {config.tokens} tokens, "
            f"{report['payload_bytes'] / 1e6:.1f} MB in {report['seconds']:.3f} s = "
            f"{report['gb_per_s']:.2f} GB/s; writes {report['transfer_requests_posted']}, "
            f"descriptors {report['descriptors']}, failures {report['failures']}, "
            f"verified={str(report['verified']).lower()}"
        )
    return 0 if report["verified"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-transfer", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_selftest_parser(subparsers)
    add_bench_parser(subparsers)
    add_engine_parser(subparsers)
    add_load_parser(subparsers)
    add_router_parser(subparsers)
    add_vllm_proxy_parser(subparsers)
    add_agent_parser(subparsers)
    add_drain_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
