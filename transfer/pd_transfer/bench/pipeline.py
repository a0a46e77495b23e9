"""``pd-transfer bench pipeline``: what layer pipelining buys, measured over real NIXL.

Prefill runs the reference model on one device (this process) and sends the KV to a decode
process (``bench.peers``) through the real ``PrefillSender`` / ``DecodeReceiver``. Per
prompt length, median of ``repeats`` runs each:

- ``C``: the forward alone (no transfer);
- ``T``: the transfer alone, of KV computed beforehand (one part, every layer);
- KV-ready latency (prefill start → decode holds every byte, request Succeeded) of
  ``serial`` (compute-then-transfer: the plain path), ``adaptive`` (the configured
  ``LayerPipelineConfig``) and ``fixed`` (``group_size`` layers per group);
- the ideal pipelined bound ``max(C, T) + min(C, T) / N`` (``N`` groups; ``C + T`` for
  serial) and measured / ideal.

After every transfer decode's pages are checked bit-exact against prefill's head slices
(SHA-256). ``prefill_tp`` / ``decode_tp``: the prefill TP ranks run in this process (the
reference model computes every rank's heads into its pool), the decode ranks in the decode
process; different TP sizes take the staged path, whose buffers are ``staging_mib`` per
prefill rank and ``ring_mib`` per decode rank. Links: ``nvlink`` (decode pool on a second
GPU, or the same GPU when there is one), ``pinned-host`` (decode pool in pinned host
memory, ~55 GB/s like a 400 Gb/s NIC; the copy up to the GPU after completion is reported
apart, ``copy_up_s``), ``dram`` (CPU).
Not a test: prints and writes numbers, asserts nothing about timings.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pd_contract.config import LayerPipelineConfig
from pd_transfer.bench.peers import (
    DecodeProcess,
    DecodeSpec,
    Link,
    PrefillPeer,
    kv_digest_of_heads,
)
from pd_transfer.kv.pipeline import GroupForward, LayerPipeline
from pd_transfer.kv.plan import compute_local_heads
from pd_transfer.reference.model import (
    ChunkForward,
    GraphedChunkForward,
    ModelConfig,
    ReferenceModel,
)

__all__ = ["PRESETS", "BenchSettings", "run_bench"]

PRESETS: dict[str, ModelConfig] = {
    # CPU: small enough that 4096 tokens compute in about a second on one core.
    "cpu-small": ModelConfig(num_layers=8, hidden_size=128, num_heads=4, num_kv_heads=4,
                             head_dim=64, intermediate_size=256, vocab_size=256),
    # GPU: ~1.2B parameters, 128 KiB of bf16 KV per token (32 layers x 8 KV heads x 128).
    "gpu-1b": ModelConfig(num_layers=32, hidden_size=2048, num_heads=16, num_kv_heads=8,
                          head_dim=128, intermediate_size=5632, vocab_size=32000),
}
MODES = ("serial", "adaptive", "fixed")


@dataclass(frozen=True)
class BenchSettings:
    device: str
    link: Link
    lengths: tuple[int, ...]
    repeats: int
    group_size: int
    model: ModelConfig
    dtype: torch.dtype
    page_size: int
    pipeline: LayerPipelineConfig
    decode_mode: str = "auto"
    seed: int = 0
    # GPU: replay the forward from per-layer CUDA graphs (GraphedChunkForward), so C is the
    # GPU's compute time rather than the host's kernel-launch time.
    cuda_graphs: bool = False
    prefill_tp: int = 1
    decode_tp: int = 1
    staging_mib: int = 64  # each prefill rank's staging buffer
    ring_mib: int = 64  # each decode rank's staging ring


@dataclass
class _Run:
    """One timed run; times are seconds relative to its start."""

    ready_s: float
    groups: int
    compute: list[tuple[float, float]] = field(default_factory=list)
    transfer: list[tuple[float, float]] = field(default_factory=list)
    copy_up_s: float = 0.0


class _GroupClock:
    """Wraps a ChunkForward and records each group's compute span (CUDA events on GPU)."""

    def __init__(self, forward: GroupForward, device: torch.device) -> None:
        self.forward = forward
        self.cuda = device.type == "cuda"
        self.host: list[tuple[float, float]] = []
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __call__(self, layers: range) -> None:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            self.forward(layers)
            end.record()
            self.events.append((start, end))
        else:
            t = time.monotonic()
            self.forward(layers)
            self.host.append((t, time.monotonic()))

    def spans(self, origin_event: torch.cuda.Event | None, origin: float) -> list[
            tuple[float, float]]:
        """Spans relative to the run start (call after the run; GPU: synchronises)."""
        if not self.cuda:
            return [(a - origin, b - origin) for a, b in self.host]
        assert origin_event is not None
        torch.cuda.synchronize()
        return [(origin_event.elapsed_time(a) / 1e3, origin_event.elapsed_time(b) / 1e3)
                for a, b in self.events]


class _Bench:
    def __init__(self, settings: BenchSettings, decode_device: str) -> None:
        self.s = settings
        self.device = torch.device(settings.device)
        self.model = ReferenceModel(settings.model, tp_size=settings.prefill_tp,
                                    seed=settings.seed, device=self.device, dtype=settings.dtype)
        max_tokens = max(settings.lengths)
        self.num_pages = -(-max_tokens // settings.page_size) + 1
        self.pages = list(range(self.num_pages))
        cpu = self.device.type == "cpu"
        self.decode = DecodeProcess(DecodeSpec(
            model=settings.model, dtype=settings.dtype, page_size=settings.page_size,
            num_pages=self.num_pages, tp=settings.decode_tp, device=decode_device,
            link=settings.link, ring_bytes=settings.ring_mib << 20,
            mode=settings.decode_mode,  # type: ignore[arg-type]
            seed=settings.seed, torch_threads=1 if cpu else 4,
        ))
        self.prefill = PrefillPeer(self.model, num_pages=self.num_pages,
                                   page_size=settings.page_size,
                                   staging_bytes=settings.staging_mib << 20,
                                   auth=self.decode.auth)
        self.decode_heads = [compute_local_heads(settings.model.num_kv_heads,
                                                 settings.decode_tp, rank)
                             for rank in range(settings.decode_tp)]
        self.prefill.connect(self.decode)
        self.rooms = 0
        self._graphed: GraphedChunkForward | None = None  # of the current prompt length

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _origin(self) -> tuple[float, torch.cuda.Event | None]:
        self._sync()
        origin = time.monotonic()
        if self.device.type != "cuda":
            return origin, None
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return origin, event

    def forward(self, tokens: torch.Tensor) -> GroupForward:
        """The prefill forward of ``tokens`` (graphed: captured once per prompt length)."""
        if not self.s.cuda_graphs:
            return ChunkForward(self.model, tokens, pools=self.prefill.pools,
                                page_table=self.pages, start_pos=0)
        n = tokens.numel()
        if self._graphed is None or self._graphed.num_tokens != n:
            self._graphed = None  # free the previous length's graphs and buffers first
            self._graphed = GraphedChunkForward(self.model, n, pools=self.prefill.pools,
                                                page_table=self.pages)
        return self._graphed.load(tokens)

    def compute_alone(self, tokens: torch.Tensor) -> float:
        origin, _ = self._origin()
        forward = self.forward(tokens)
        forward(range(self.s.model.num_layers))
        self._sync()
        return time.monotonic() - origin

    def transfer_run(self, tokens: torch.Tensor, mode: str) -> _Run:
        """One request: ``mode`` in MODES, or "transfer" (KV computed before the clock)."""
        n = tokens.numel()
        pages = self.pages[: -(-n // self.s.page_size)]
        self.rooms += 1
        room = f"{mode}-{n}-{self.rooms}"
        self.prefill.register(room, pages, n)
        assert self.decode.ask("expect", room, pages, n) == "ok"
        self.prefill.wait_transferring(room)
        forward = self.forward(tokens)
        clock = _GroupClock(forward, self.device)
        config = self._config(mode)
        if mode == "transfer":
            forward(range(self.s.model.num_layers))
        origin, origin_event = self._origin()
        if mode == "transfer":
            self.prefill.send_part(room, range(len(pages)), None, last=True)
            groups = 1
        else:
            pipeline = LayerPipeline(config, self.s.model.num_layers, self.prefill,
                                     device=self.device)
            groups = len(pipeline.run_chunk(room, clock, num_tokens=n,
                                            pages=range(len(pages)), last=True).groups)
        result = self.decode.ask("wait", room, pages, 300.0)
        state = self.prefill.wait_finished(room)
        if set(result["states"]) != {"Succeeded"} or state != "Succeeded":
            raise RuntimeError(f"{room}: decode {result['states']}, prefill {state}")
        digests = self.decode.ask("digest", pages)
        expected = [kv_digest_of_heads(self.prefill.pools, self.model, pages,
                                       range(h.start, h.stop)) for h in self.decode_heads]
        if digests != expected:
            raise RuntimeError(f"{room}: decode KV differs from prefill's (bit-exact check)")
        writes = self.prefill.take_writes(room)
        transfer = [(writes.get(part, arrived) - origin, arrived - origin)
                    for part, arrived, _ in result["arrivals"][0]]
        return _Run(result["ready_at"] - origin, groups, clock.spans(origin_event, origin),
                    transfer, result["copy_up_s"])

    def _config(self, mode: str) -> LayerPipelineConfig:
        base = self.s.pipeline
        if mode in {"serial", "transfer"}:
            return base.model_copy(update={"enabled": False})
        if mode == "fixed":
            return base.model_copy(update={"enabled": True, "group_size": self.s.group_size,
                                           "min_tokens": 1})
        return base.model_copy(update={"group_size": None})


def _median_run(runs: list[_Run]) -> _Run:
    ordered = sorted(runs, key=lambda r: r.ready_s)
    return ordered[len(ordered) // 2]


def run_bench(settings: BenchSettings, log: Callable[[str], None] = print,
              checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every length and mode; return the JSON-ready report (see module docstring).
    ``checkpoint`` gets the report so far after each length (a run cut short keeps them)."""
    decode_device = settings.device
    if settings.device.startswith("cuda") and settings.link == "nvlink":
        decode_device = "cuda:1" if torch.cuda.device_count() > 1 else settings.device
    bench = _Bench(settings, decode_device)
    report: dict[str, Any] = {
        "benchmark": "pipeline",
        "device": _device_name(settings.device),
        "decode_device": _device_name(decode_device),
        "link": settings.link,
        "host": platform.node(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "model": asdict(settings.model),
        "dtype": str(settings.dtype).removeprefix("torch."),
        "page_size": settings.page_size,
        "pipeline": settings.pipeline.model_dump(),
        "group_size": settings.group_size,
        "repeats": settings.repeats,
        "cuda_graphs": settings.cuda_graphs,
        "prefill_tp": settings.prefill_tp,
        "decode_tp": settings.decode_tp,
        "staging_mib": settings.staging_mib,
        "ring_mib": settings.ring_mib,
        "ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"),
        "clock": "time.monotonic (CLOCK_MONOTONIC, shared by both processes)",
        "verified": "SHA-256 of decode's pages equals prefill's after every transfer",
        "results": [],
    }
    try:
        generator = torch.Generator().manual_seed(settings.seed)
        for n in settings.lengths:
            tokens = torch.randint(0, settings.model.vocab_size, (n,), generator=generator)
            bench.compute_alone(tokens)  # warm-up: allocator, kernels, first NIXL paths
            bench.transfer_run(tokens, "transfer")
            compute = statistics.median(bench.compute_alone(tokens)
                                        for _ in range(settings.repeats))
            transfer = statistics.median(bench.transfer_run(tokens, "transfer").ready_s
                                         for _ in range(settings.repeats))
            row: dict[str, Any] = {"tokens": n, "compute_s": compute, "transfer_s": transfer,
                                   "kv_bytes": n * _kv_bytes_per_token(settings), "modes": {}}
            for mode in MODES:
                runs = [bench.transfer_run(tokens, mode) for _ in range(settings.repeats)]
                median = _median_run(runs)
                groups = median.groups
                ideal = (compute + transfer if groups == 1 else
                         max(compute, transfer) + min(compute, transfer) / groups)
                ready = statistics.median(r.ready_s for r in runs)
                row["modes"][mode] = {
                    "ready_s": ready, "groups": groups, "ideal_s": ideal,
                    "measured_over_ideal": ready / ideal,
                    "copy_up_s": statistics.median(r.copy_up_s for r in runs),
                    "timeline": {"compute": median.compute, "transfer": median.transfer,
                                 "ready_s": median.ready_s},
                }
            report["results"].append(row)
            log(_format_row(row))
            if checkpoint is not None:
                checkpoint(report)
    finally:
        bench.close()
    return report


def _kv_bytes_per_token(settings: BenchSettings) -> int:
    m = settings.model
    element = torch.empty((), dtype=settings.dtype).element_size()
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * element


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return f"cpu ({platform.processor() or platform.machine()})"


def _format_row(row: dict[str, Any]) -> str:
    parts = [f"{row['tokens']:>6} tok  C {row['compute_s'] * 1e3:8.2f} ms  "
             f"T {row['transfer_s'] * 1e3:8.2f} ms"]
    for mode, m in row["modes"].items():
        parts.append(f"{mode} {m['ready_s'] * 1e3:8.2f} ms (N={m['groups']}, "
                     f"x{m['measured_over_ideal']:.2f} ideal)")
    return " | ".join(parts)


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
