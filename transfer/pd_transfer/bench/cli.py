"""``pd-transfer bench ...``: the benchmark subcommands (``add_bench_parser`` hooks them
into ``pd_transfer.cli``; ``python -m pd_transfer.bench.cli`` runs them standalone).

Nothing heavy is imported until a benchmark runs, so ``pd-transfer --help`` stays fast.

``bench pipeline`` measures layer pipelining over real NIXL (``bench.pipeline``), prints one
line per prompt length and optionally writes the JSON report and the PNG timeline.
``bench transfer`` measures a request's transfer end to end per TP combination, staged vs
contiguous vs raw NIXL, with each request's phases (``bench.transfer``, ``bench.phases``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

__all__ = ["add_bench_parser", "main"]

_DTYPES = ("float32", "bfloat16", "float16")


def add_bench_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench`` (its ``pipeline`` and ``transfer`` subcommands) to a ``pd-transfer``
    parser."""
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
    p.add_argument("--prefill-tp", type=int, default=1,
                   help="prefill TP ranks (in this process; the model splits its heads)")
    p.add_argument("--decode-tp", type=int, default=1, help="decode TP ranks")
    p.add_argument("--prefill-buffer-mib", type=int, default=64,
                   help="each prefill rank's staging buffer (staged path)")
    p.add_argument("--decode-pool-mib", type=int, default=64,
                   help="each decode rank's staging ring (staged path)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="GPU: replay the forward from per-layer CUDA graphs, so compute time "
                        "is the GPU's, not the host's kernel launches (default: on for cuda)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for prefill compute (default: 1 on CPU, so the "
                        "transfer workers keep a core)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--timeline", type=Path, default=None, help="write the PNG timeline here")
    p.set_defaults(handler=_run_pipeline)
    _add_transfer_parser(kinds)


def _add_transfer_parser(kinds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = kinds.add_parser(
        "transfer", help="staged vs contiguous vs raw NIXL, per TP combination, with phases",
        description="Prefill and decode ranks as processes over NIXL; per TP combination and "
                    "prompt length: per-request latency at 1 in flight and throughput at "
                    "--concurrency in flight, of the staged and contiguous paths and of raw "
                    "one-descriptor NIXL WRITEs of the same bytes between the same processes; "
                    "each request's latency split into phases from the endpoints' stamps.",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--gpus", type=int, choices=[1, 2], default=1,
                   help="cuda: 1 (every rank on cuda:0) or 2 (decode ranks on cuda:1)")
    p.add_argument("--combos", default="2-4:8,4-2:8,1-1:8,8-2:2",
                   help="prefill_tp-decode_tp:kv_heads, comma-separated")
    p.add_argument("--lengths", default=None,
                   help="prompt lengths (default: 256..32768 on cuda, 256,1024,4096 on cpu)")
    p.add_argument("--paths", default="raw,staged,contiguous",
                   help="of raw, staged, contiguous (contiguous only where heads are whole)")
    p.add_argument("--layers", type=int, default=None, help="default 16 on cuda, 4 on cpu")
    p.add_argument("--head-dim", type=int, default=None, help="default 128 on cuda, 64 on cpu")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=_DTYPES, default="bfloat16")
    p.add_argument("--repeats", type=int, default=5, help="requests at 1 in flight (median)")
    p.add_argument("--waves", type=int, default=3, help="waves at --concurrency (median)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--staging-mib", type=int, default=None,
                   help="each prefill rank's staging buffer (default: --concurrency requests)")
    p.add_argument("--ring-mib", type=int, default=None,
                   help="each decode rank's ring (default: --concurrency requests)")
    p.add_argument("--poll-us", default=None,
                   help="MOVING,WAITING: the rank workers' sleep caps in µs while a part is in "
                        "flight / a request waits for its peer (default: the endpoints')")
    p.add_argument("--pregrant-share", type=float, default=None,
                   help="the share of each decode ring pre-grants may hold (0: every part "
                        "asks with an AllocRequest; default: the receiver's)")
    p.add_argument("--ready-events", action="store_true",
                   help="cuda: give each part a CUDA event recorded at send_part, as the "
                        "engine connectors do (default: none; send_part then marks the "
                        "default stream)")
    p.add_argument("--progress-thread", action="store_true",
                   help="run each rank's NIXL agent with its progress thread (default: "
                        "none; the workers' polls progress the agent)")
    p.add_argument("--timer-slack-ns", type=int, default=None,
                   help="the rank workers' timer slack in ns (Linux; default: the "
                        "kernel's, 50 µs)")
    p.add_argument("--engine-busy", action="store_true",
                   help="cuda: each prefill rank's engine thread launches a small kernel back to "
                        "back up to the common start instant, a stand-in for the forward pass "
                        "an engine runs until it calls send_part (default: it waits idle)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--chart", type=Path, default=None, help="write the PNG of phases here")
    p.set_defaults(handler=_run_transfer)


def _run_transfer(args: argparse.Namespace) -> int:
    from pd_transfer.bench.transfer import (  # noqa: PLC0415 - keep `pd-transfer --help` light
        Combo,
        TransferBenchSettings,
        run_transfer_bench,
        write_json,
    )

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    gpu = args.device == "cuda"
    combos = []
    for item in args.combos.split(","):
        tps, heads = item.split(":")
        prefill_tp, decode_tp = tps.split("-")
        combos.append(Combo(int(prefill_tp), int(decode_tp), int(heads)))
    lengths = args.lengths or ("256,1024,4096,16384,32768" if gpu else "256,1024,4096")
    settings = TransferBenchSettings(
        device=args.device, gpus=args.gpus if gpu else 1, combos=tuple(combos),
        lengths=tuple(int(x) for x in lengths.split(",") if x),
        paths=tuple(p for p in args.paths.split(",") if p),
        layers=args.layers or (16 if gpu else 4), head_dim=args.head_dim or (128 if gpu else 64),
        page_size=args.page_size, dtype=args.dtype, repeats=args.repeats, waves=args.waves,
        concurrency=args.concurrency, staging_mib=args.staging_mib, ring_mib=args.ring_mib,
        poll_us=None if args.poll_us is None else (
            float(args.poll_us.split(",")[0]), float(args.poll_us.split(",")[1])),
    )
    if args.pregrant_share is not None:
        settings = replace(settings, pregrant_share=args.pregrant_share)
    settings = replace(settings, ready_events=args.ready_events,
                       progress_thread=args.progress_thread,
                       timer_slack_ns=args.timer_slack_ns, engine_busy=args.engine_busy)
    if settings.timer_slack_ns is not None and settings.timer_slack_ns <= 0:
        print(f"--timer-slack-ns must be positive, got {settings.timer_slack_ns}",
              file=sys.stderr)
        return 2
    if settings.engine_busy and not gpu:
        print("--engine-busy needs --device cuda (it launches CUDA kernels)", file=sys.stderr)
        return 2
    unknown = set(settings.paths) - {"raw", "staged", "contiguous"}
    if unknown:
        print(f"unknown paths {sorted(unknown)}", file=sys.stderr)
        return 2
    print(f"bench transfer: {settings.device} x{settings.gpus}, {settings.layers} layers x "
          f"head dim {settings.head_dim} {settings.dtype}, page {settings.page_size}, "
          f"lengths {settings.lengths}, {settings.repeats} requests at 1 in flight, "
          f"{settings.waves} waves of {settings.concurrency}, worker poll caps (µs) "
          f"{settings.poll_us or 'endpoint default'}, pre-grant share "
          f"{'receiver default' if settings.pregrant_share is None else settings.pregrant_share}"
          f", ready events {'on' if settings.ready_events else 'off'}, NIXL progress "
          f"thread {'on' if settings.progress_thread else 'off'}, worker timer slack "
          f"{settings.timer_slack_ns or 'kernel default'}, engine thread "
          f"{'busy' if settings.engine_busy else 'idle'} up to the start, UCX_TLS "
          f"{os.environ.get('UCX_TLS', '(UCX default)')}")
    json_path = args.json
    report = run_transfer_bench(settings, checkpoint=None if json_path is None
                                else lambda partial: write_json(partial, json_path))
    if json_path is not None:
        write_json(report, json_path)
        print(f"wrote {json_path}")
    if args.chart is not None:
        from pd_transfer.bench.phases import write_phase_chart  # noqa: PLC0415 - matplotlib

        write_phase_chart(report, args.chart)
        print(f"wrote {args.chart}")
    return 0


def _run_pipeline(args: argparse.Namespace) -> int:
    from dataclasses import replace  # noqa: PLC0415 - keep `pd-transfer --help` light

    import torch  # noqa: PLC0415

    from pd_contract.config import LayerPipelineConfig  # noqa: PLC0415
    from pd_transfer.bench.peers import Link  # noqa: PLC0415
    from pd_transfer.bench.pipeline import PRESETS, BenchSettings, run_bench, write_json  # noqa: PLC0415

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
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        staging_mib=args.prefill_buffer_mib,
        ring_mib=args.decode_pool_mib,
    )
    print(f"bench pipeline: prefill {settings.device}, link {link}, model {preset} "
          f"{model}, dtype {settings.dtype}, page {settings.page_size}, "
          f"repeats {settings.repeats}, torch threads {torch.get_num_threads()}, "
          f"CUDA graphs {settings.cuda_graphs}, TP {settings.prefill_tp} -> "
          f"{settings.decode_tp}, buffers {settings.staging_mib}/{settings.ring_mib} MiB, UCX_TLS "
          f"{os.environ.get('UCX_TLS', '(UCX default)')}")
    json_path = args.json
    report = run_bench(settings, checkpoint=None if json_path is None
                       else lambda partial: write_json(partial, json_path))
    if args.json is not None:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.timeline is not None:
        from pd_transfer.bench.timeline import write_timeline  # noqa: PLC0415 - matplotlib

        write_timeline(report, args.timeline)
        print(f"wrote {args.timeline}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry: ``python -m pd_transfer.bench.cli pipeline ...``."""
    parser = argparse.ArgumentParser(prog="pd-transfer")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
