"""``pd-transfer bench ...``: the benchmark subcommands (``add_bench_parser`` hooks them
into ``pd_transfer.cli``; ``python -m pd_transfer.bench_cli`` runs them standalone).

Nothing heavy is imported until a benchmark runs, so ``pd-transfer --help`` stays fast.

``bench pipeline`` measures layer pipelining over real NIXL (``bench_pipeline``), prints one
line per prompt length and optionally writes the JSON report and the PNG timeline.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["add_bench_parser", "main"]

_DTYPES = ("float32", "bfloat16", "float16")


def add_bench_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench`` (with its ``pipeline`` subcommand) to a ``pd-transfer`` parser."""
    bench = subparsers.add_parser("bench", help="benchmarks (not tests: print numbers)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    p = kinds.add_parser(
        "pipeline", help="layer-pipelined vs compute-then-transfer KV-ready latency over NIXL",
        description="Prefill runs the reference model and sends its KV over NIXL to a "
                    "decode process; per prompt length it reports compute C, transfer T, the "
                    "KV-ready latency of compute-then-transfer, adaptive and fixed layer "
                    "groups, the ideal max(C,T)+min(C,T)/N and measured/ideal.",
    )
    p.add_argument("--device", default="cpu", help="prefill device: cpu or cuda:0")
    p.add_argument("--link", choices=["nvlink", "pinned-host", "dram"], default=None,
                   help="decode landing memory: nvlink (GPU; cuda:1 when present), "
                        "pinned-host (NIC-class, ~55 GB/s), dram (CPU). Default by device.")
    p.add_argument("--lengths", default="256,1024,4096,16384,32768",
                   help="comma-separated prompt lengths")
    p.add_argument("--repeats", type=int, default=3, help="runs per point; medians reported")
    p.add_argument("--group-size", type=int, default=4, help="layers per group, fixed mode")
    p.add_argument("--preset", choices=["auto", "cpu-small", "gpu-1b"], default="auto",
                   help="model geometry (auto: cpu-small on CPU, gpu-1b on GPU)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layers")
    p.add_argument("--dtype", choices=_DTYPES, default=None,
                   help="default float32 on CPU, bfloat16 on GPU")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--min-tokens", type=int, default=512, help="layerPipeline.minTokens")
    p.add_argument("--min-groups", type=int, default=2)
    p.add_argument("--max-groups", type=int, default=8)
    p.add_argument("--saturation", type=float, default=16.0)
    p.add_argument("--decode-mode", choices=["auto", "staged", "contiguous"], default="auto",
                   help="send path decode asks for (auto: contiguous for TP 1 -> TP 1)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="GPU: replay the forward from per-layer CUDA graphs, so compute time "
                        "is the GPU's, not the host's kernel launches (default: on for cuda)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for prefill compute (default: 1 on CPU, so the "
                        "transfer workers keep a core)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--timeline", type=Path, default=None, help="write the PNG timeline here")
    p.set_defaults(handler=_run_pipeline)


def _run_pipeline(args: argparse.Namespace) -> int:
    from dataclasses import replace  # noqa: PLC0415 - keep `pd-transfer --help` light

    import torch  # noqa: PLC0415

    from pd_contract.config import LayerPipelineConfig  # noqa: PLC0415
    from pd_transfer._bench_peers import Link  # noqa: PLC0415
    from pd_transfer.bench_pipeline import PRESETS, BenchSettings, run_bench, write_json  # noqa: PLC0415

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    gpu = args.device.startswith("cuda")
    preset = args.preset if args.preset != "auto" else ("gpu-1b" if gpu else "cpu-small")
    model = PRESETS[preset]
    if args.layers is not None:
        model = replace(model, num_layers=args.layers)
    links: dict[str, Link] = {"nvlink": "nvlink", "pinned-host": "pinned-host", "dram": "dram"}
    link = links[args.link or ("nvlink" if gpu else "dram")]
    if gpu == (link == "dram"):
        print(f"--link {link} does not fit --device {args.device}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads or (torch.get_num_threads() if gpu else 1))
    settings = BenchSettings(
        device=args.device,
        link=link,
        lengths=tuple(int(x) for x in args.lengths.split(",") if x),
        repeats=args.repeats,
        group_size=args.group_size,
        model=model,
        dtype=getattr(torch, args.dtype or ("bfloat16" if gpu else "float32")),
        page_size=args.page_size,
        pipeline=LayerPipelineConfig(enabled=True, min_tokens=args.min_tokens,
                                     min_groups=args.min_groups, max_groups=args.max_groups,
                                     saturation=args.saturation),
        decode_mode=args.decode_mode,
        cuda_graphs=gpu if args.cuda_graphs is None else args.cuda_graphs and gpu,
    )
    print(f"bench pipeline: prefill {settings.device}, link {link}, model {preset} "
          f"{model}, dtype {settings.dtype}, page {settings.page_size}, "
          f"repeats {settings.repeats}, torch threads {torch.get_num_threads()}, "
          f"CUDA graphs {settings.cuda_graphs}, UCX_TLS "
          f"{os.environ.get('UCX_TLS', '(UCX default)')}")
    json_path = args.json
    report = run_bench(settings, checkpoint=None if json_path is None
                       else lambda partial: write_json(partial, json_path))
    if args.json is not None:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.timeline is not None:
        from pd_transfer.bench_timeline import write_timeline  # noqa: PLC0415 - matplotlib

        write_timeline(report, args.timeline)
        print(f"wrote {args.timeline}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry: ``python -m pd_transfer.bench_cli pipeline ...``."""
    parser = argparse.ArgumentParser(prog="pd-transfer")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
