"""``pd-transfer bench transfer``: a request's KV transfer end to end, against raw NIXL.

Per TP combination (prefill TP → decode TP, KV heads) one group of rank processes
(``bench._ranks``: real ``PrefillSender`` / ``DecodeReceiver`` over NIXL, one process per
rank). Per prompt length, interleaved, in the same processes:

- ``raw``: one-descriptor NIXL WRITEs of the same bytes (each pair's staged chunk) from the
  prefill ranks' staging buffers into the decode rings, posted by the ranks' own workers,
  timed post → DONE: what the link itself takes;
- ``staged``: gather, AllocRequest → Grant, ONE WRITE per pair, scatter;
- ``contiguous``: straight into decode's pages, one descriptor per page run (only where
  every pair moves whole local heads: 1 → 1, or 8 → 2 with 2 KV heads).

Latency = from a common start instant (every prefill rank calls ``send_part`` or posts at
that instant) to the last decode rank's request Succeeded (raw: the last WRITE DONE); median
of ``repeats`` requests at 1 in flight. Throughput = bytes / time for ``concurrency``
requests started together, median of ``waves``. Each staged / contiguous request's latency
is split into phases from the endpoints' own stamps (``bench.phases``). Every request's
decode KV is checked bit-exact; a mismatch or failure stops the run. Prefill source pages
are shared by the requests of a wave (one seed per wave; decode pages are distinct and
poisoned before each request). Not a test: prints and writes numbers, asserts no timing.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pd_transfer.bench._ranks import BenchGroup, GroupSpec, compute_pair_bytes
from pd_transfer.bench.phases import compute_phases
from pd_transfer.common.paths import choose_path
from pd_transfer.kv.layout import KVLayout
from pd_transfer.kv.plan import Parallelism, compute_local_heads, compute_transfer_topology
from pd_transfer.transport.nixl import NixlTransport
from pd_transfer.trust.bootstrap import DTYPES, DtypeName

__all__ = ["Combo", "TransferBenchSettings", "run_transfer_bench", "write_json"]

MIB = 1 << 20
SETTLE_S = 0.005  # after registration: every RequestKV is in before the clock starts
START_AHEAD_S = 0.005  # the common start instant, after every rank got its command


@dataclass(frozen=True)
class Combo:
    prefill_tp: int
    decode_tp: int
    kv_heads: int

    @property
    def name(self) -> str:
        return f"{self.prefill_tp}->{self.decode_tp} ({self.kv_heads} KV heads)"


@dataclass(frozen=True)
class TransferBenchSettings:
    device: str  # "cpu" or "cuda"
    gpus: int
    combos: tuple[Combo, ...]
    lengths: tuple[int, ...]
    paths: tuple[str, ...]  # of raw, staged, contiguous
    layers: int
    head_dim: int
    page_size: int
    dtype: DtypeName
    repeats: int
    waves: int
    concurrency: int
    staging_mib: int | None = None  # per prefill rank; None: room for `concurrency` requests
    ring_mib: int | None = None  # per decode rank; likewise
    seed: int = 0
    poll_us: tuple[float, float] | None = None  # workers' sleep caps (default: the endpoint's)
    pregrant_share: float | None = None  # decode's ring share for pre-grants (None: the
    #                                      receiver's default, 0: none)
    ready_events: bool = False  # cuda: each part carries a ready event, as an engine's does
    progress_thread: bool = False  # each rank's NIXL agent runs its progress thread
    timer_slack_ns: int | None = None  # the rank workers' timer slack (None: the kernel's)
    engine_busy: bool = False  # cuda: engine threads launch a stand-in forward up to the start


def _contiguous_possible(settings: TransferBenchSettings, combo: Combo) -> bool:
    kv = GroupSpec(combo.prefill_tp, combo.decode_tp, settings.layers, combo.kv_heads,
                   settings.head_dim, settings.page_size, settings.dtype, "cpu", 1, 1, 1, 256,
                   256).geometry().kv_geometry()

    def layout(tp: int, rank: int) -> KVLayout:
        heads = compute_local_heads(combo.kv_heads, tp, rank).count
        return KVLayout(1, 1, settings.page_size, heads, settings.head_dim,
                        DTYPES[settings.dtype])

    topology = compute_transfer_topology(kv, Parallelism(combo.prefill_tp),
                                         Parallelism(combo.decode_tp))
    try:
        for plan in topology.plans:
            choose_path("contiguous", plan, layout(combo.prefill_tp, plan.prefill.tp_rank),
                        layout(combo.decode_tp, plan.decode.tp_rank))
    except ValueError:
        return False
    return True


def _group_spec(settings: TransferBenchSettings, combo: Combo) -> GroupSpec:
    longest = max(settings.lengths)
    pages = -(-longest // settings.page_size)
    base = GroupSpec(combo.prefill_tp, combo.decode_tp, settings.layers, combo.kv_heads,
                     settings.head_dim, settings.page_size, settings.dtype, settings.device,
                     settings.gpus, pages + 1, settings.concurrency * pages + 1, MIB, MIB)
    topology = compute_transfer_topology(base.geometry().kv_geometry(),
                                         Parallelism(combo.prefill_tp),
                                         Parallelism(combo.decode_tp))
    per_prefill = [sum(compute_pair_bytes(base, p, longest) for p in topology.plans
                       if p.prefill.tp_rank == r) for r in range(combo.prefill_tp)]
    per_decode = [sum(compute_pair_bytes(base, p, longest) for p in topology.plans
                      if p.decode.tp_rank == r) for r in range(combo.decode_tp)]

    def room(needed: int, mib: int | None) -> int:
        return (mib << 20) if mib is not None else -(-needed * settings.concurrency // MIB) * MIB

    return replace(base, staging_bytes=room(max(per_prefill), settings.staging_mib),
                   ring_bytes=room(max(per_decode), settings.ring_mib), poll_us=settings.poll_us,
                   pregrant_share=settings.pregrant_share, ready_events=settings.ready_events,
                   progress_thread=settings.progress_thread,
                   timer_slack_ns=settings.timer_slack_ns, engine_busy=settings.engine_busy)


class _Runner:
    """One combo's rank group and its requests."""

    def __init__(self, settings: TransferBenchSettings, combo: Combo) -> None:
        self.s, self.combo = settings, combo
        self.spec = _group_spec(settings, combo)
        self.group = BenchGroup(self.spec)
        self.rng = random.Random(settings.seed)
        self.rooms = 0
        kv = self.spec.geometry().kv_geometry()
        self.topology = compute_transfer_topology(kv, Parallelism(combo.prefill_tp),
                                                  Parallelism(combo.decode_tp))

    def payload(self, num_tokens: int) -> int:
        return sum(compute_pair_bytes(self.spec, p, num_tokens) for p in self.topology.plans)

    def wave(self, path: str, num_tokens: int, count: int) -> list[dict[str, Any]]:
        """``count`` requests started together on ``path``; one result per request (raw: one
        for the whole wave)."""
        pages = -(-num_tokens // self.s.page_size)
        if path == "raw":
            return [self._raw(num_tokens, count)]
        seed = self.rng.randrange(1 << 30)
        src = self.rng.sample(range(self.spec.prefill_pages), pages)
        dst = self.rng.sample(range(self.spec.decode_pages), pages * count)
        rooms = []
        for i in range(count):
            self.rooms += 1
            rooms.append((f"{path}-{num_tokens}-{self.rooms}", dst[i * pages:(i + 1) * pages]))
        group = self.group
        group.ask("prefill", "fill", src, seed)
        group.ask("decode", "expect", [(r, d, num_tokens, path) for r, d in rooms])
        group.ask("prefill", "register", [(r, src, num_tokens) for r, _ in rooms])
        names = [r for r, _ in rooms]
        deadline = time.monotonic() + self.spec.timeout_s
        while time.monotonic() < deadline:  # every serving prefill rank got a RequestKV
            states = group.ask("prefill", "states", names)
            if all(s != "Bootstrapping" for ranks in states.values() for s in ranks):
                break
            time.sleep(0.001)
        time.sleep(SETTLE_S)
        start = time.monotonic() + START_AHEAD_S
        group.ask("prefill", "send", start, names)
        decode = group.ask("decode", "wait", names, [(d, num_tokens, seed) for _, d in rooms])
        prefill = group.ask("prefill", "wait", names, None)
        results = []
        for index, room in enumerate(names):
            ends = [r[index] for r in decode.values()]
            bad = [r for r in ends if r["state"] != "Succeeded" or r["verified"] is not True]
            bad += [r[index] for r in prefill.values() if r[index]["state"] not in (
                "Succeeded", None)]
            if bad:
                raise RuntimeError(f"{room}: failed or not bit-exact: {bad[:2]}")
            finished = max(r["times"]["finished"] for r in ends)
            results.append({
                "room": room, "start": start, "latency_s": finished - start,
                "phases": compute_phases(
                    start, {k: v[index]["times"] for k, v in prefill.items()
                            if v[index]["times"] is not None},
                    {k: v[index]["times"] for k, v in decode.items()},
                    self.group.agents),
            })
        return results

    def _raw(self, num_tokens: int, count: int) -> dict[str, Any]:
        start = time.monotonic() + START_AHEAD_S
        answers = self.group.ask("prefill", "raw", start, num_tokens, count)
        done = [t for a in answers.values() for t in a["done"]]
        posted = [t for a in answers.values() for t in a["posted"]]
        return {"start": start, "latency_s": max(done) - start,
                "bytes": sum(a["bytes"] for a in answers.values()),
                "posted_s": [t - start for t in posted], "done_s": [t - start for t in done]}

    def close(self) -> None:
        self.group.close()


def _summary(runs: list[list[dict[str, Any]]], payload: int, *, wave: bool) -> dict[str, Any]:
    """Median latency of single requests, or throughput of waves, over the runs."""
    if not wave:
        latencies = [r[0]["latency_s"] for r in runs]
        return {"latency_s": statistics.median(latencies), "all_s": latencies}
    spans = [max(x["latency_s"] for x in r) for r in runs]
    median = statistics.median(spans)
    return {"wave_s": median, "gb_per_s": payload * len(runs[0]) / median / 1e9,
            "all_s": spans}


def run_transfer_bench(settings: TransferBenchSettings, log: Callable[[str], None] = print,
                       checkpoint: Callable[[dict[str, Any]], None] | None = None
                       ) -> dict[str, Any]:
    """Every combo, length and path (module docstring); the JSON-ready report."""
    report: dict[str, Any] = {
        "benchmark": "transfer",
        "device": _device_name(settings),
        "link": _link_name(settings),
        "host": platform.node(),
        "torch": torch.__version__,
        "nixl": NixlTransport.nixl_version(),
        "ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"),
        "settings": asdict(settings),
        "clock": "time.monotonic (CLOCK_MONOTONIC, shared by every rank process)",
        "verified": "every request's decode KV bit-exact (hashed per layer/part/token/head)",
        "results": [],
    }
    for combo in settings.combos:
        paths = [p for p in settings.paths
                 if p != "contiguous" or _contiguous_possible(settings, combo)]
        runner = _Runner(settings, combo)
        log(f"{combo.name}: staging {runner.spec.staging_bytes // MIB} MiB per prefill rank, "
            f"ring {runner.spec.ring_bytes // MIB} MiB per decode rank, paths {paths}")
        try:
            for n in settings.lengths:
                payload = runner.payload(n)
                for path in paths:  # warm-up: kernels, first transfers, allocator
                    runner.wave(path, n, 1)
                single: dict[str, list[list[dict[str, Any]]]] = {p: [] for p in paths}
                for _ in range(settings.repeats):
                    for path in paths:
                        single[path].append(runner.wave(path, n, 1))
                multi: dict[str, list[list[dict[str, Any]]]] = {p: [] for p in paths}
                for _ in range(settings.waves):
                    for path in paths:
                        wave = runner.wave(path, n, settings.concurrency)
                        multi[path].append(wave if path != "raw" else
                                           [wave[0]] * settings.concurrency)
                row: dict[str, Any] = {"combo": asdict(combo), "tokens": n,
                                       "payload_bytes": payload, "paths": {}}
                for path in paths:
                    one = _summary(single[path], payload, wave=False)
                    many = _summary(multi[path], payload, wave=True)
                    entry: dict[str, Any] = {"one_in_flight": one, "in_flight": many}
                    entry["requests"] = [r[0] for r in single[path]]
                    if path != "raw":
                        entry["wave_requests"] = multi[path][len(multi[path]) // 2]
                    row["paths"][path] = entry
                report["results"].append(row)
                log(_format_row(row, settings.concurrency))
                if checkpoint is not None:
                    checkpoint(report)
            report.setdefault("prefill_stats", {})[combo.name] = {
                str(rank): stats for rank, stats in runner.group.ask("prefill", "stats").items()}
        finally:
            runner.close()
    return report


def _format_row(row: dict[str, Any], concurrency: int) -> str:
    combo = row["combo"]
    cells = [f"{combo['prefill_tp']}->{combo['decode_tp']} h{combo['kv_heads']} "
             f"{row['tokens']:>6} tok {row['payload_bytes'] / MIB:8.1f} MiB"]
    for path, entry in row["paths"].items():
        cells.append(f"{path} {entry['one_in_flight']['latency_s'] * 1e3:8.3f} ms, "
                     f"x{concurrency} {entry['in_flight']['gb_per_s']:7.1f} GB/s")
    return " | ".join(cells)


def _device_name(settings: TransferBenchSettings) -> str:
    if settings.device == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(min(settings.gpus,
                                                                  torch.cuda.device_count()))]
        return f"{settings.gpus} x {names[0]}" if names else "cuda"
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _link_name(settings: TransferBenchSettings) -> str:
    if settings.device == "cpu":
        return "NIXL UCX between processes, DRAM -> DRAM"
    if settings.gpus > 1:
        return "NIXL UCX between processes, cuda:0 -> cuda:1"
    return "NIXL UCX between processes on one GPU (cuda:0 -> cuda:0)"


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
