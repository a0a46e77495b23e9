"""vLLM prefill/decode on CPU (not a test): TTFT of one vLLM instance against P/D setups.

Real vLLM servers (CPU backend, the vLLM virtualenv of `pd_devcluster.vllm_env`),
the tiny dummy-weight Llama of `pd_testbed.vllm.model`, token-id prompts of each
`--lengths` (default 16, 128, 512, 1024, 1500), `--repeats` different prompts per length
(prefix caching off), greedy, `--max-tokens` tokens each. Per setup and length: TTFT p50/p99
as the client sees it (stream=True; request sent -> first streamed token; for P/D the
prefill request's latency plus decode's TTFT, as a sequential proxy sees it), the KV
transfer time where the setup reports one, and whether the token ids equal the first
setup's for the same prompt.

Setups (`--setups`, comma-separated; `--connector` appends one more):
- `single`: one vLLM instance.
- `nixl`: vLLM's own NixlConnector, prefill + decode servers, sequential proxy (prefill with
  `do_remote_decode` and 1 token, then decode with the returned `kv_transfer_params`); the
  transfer time is the decode server's `vllm:nixl_xfer_time_seconds` delta per request.
- `pd_transfer`: our PDTransferConnector, prefill + decode servers behind
  `pd-transfer router` (`pd_transfer.router`), which sends each request to both at once
  (the TTFT is the router's, end to end); the transfer time is decode's own (its timeline:
  from asking prefill for the KV to all of it landed).
A setup is a function `(SetupContext) -> Complete`: it starts its servers (registering their
stop on `ctx.stack`) and returns `complete(prompt_ids) -> Sample`. `--connector NAME` takes
a name from `SETUPS` or `package.module:function` with that signature.

Run: `.venv/bin/python benchmarks/vllm_pd_cpu.py [--repeats 5] [--setups single,nixl,pd_transfer]
[--connector NAME]`. Needs the vLLM virtualenv (`python -m pd_devcluster.vllm_env`).
Writes `benchmarks/results/vllm_pd_cpu-<time>.json` and prints a table.
"""

from __future__ import annotations

import argparse
import http.client
import importlib
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The checkout (for `--connector package.module:function`) and the test bed (pd_testbed).
sys.path[:0] = [str(REPO), str(REPO / "devtools")]

from pd_devcluster.vllm_env import VllmEnv, require_vllm_env  # noqa: E402
from pd_testbed.vllm import (  # noqa: E402
    ModelSpec,
    VllmServer,
    complete,
    free_ports,
    nixl_pd_complete,
    nixl_server_pair,
    pd_transfer_pair,
    prompt_ids,
    start_servers,
    warm_up_pd,
)
from pd_transfer.router import PolicyName, Router, RouterSettings  # noqa: E402

DEFAULT_LENGTHS = (16, 128, 512, 1024, 1500)


@dataclass(frozen=True)
class Sample:
    """One request through a setup."""

    token_ids: list[int]
    ttft_s: float
    kv_transfer_s: float | None = None
    parts: dict[str, float] = field(default_factory=dict)  # e.g. prefill_s, decode_ttft_s


Complete = Callable[[Sequence[int]], Sample]


@dataclass
class SetupContext:
    """What a setup needs to start servers; everything on `stack` is closed after it."""

    vllm: VllmEnv
    model: ModelSpec
    model_dir: Path
    log_dir: Path
    stack: ExitStack
    max_tokens: int
    max_num_batched_tokens: int
    max_model_len: int
    worker_process: bool = False
    startup_s: dict[str, float] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def server_options(self) -> dict[str, Any]:
        return {"max_num_batched_tokens": self.max_num_batched_tokens,
                "max_model_len": self.max_model_len, "worker_process": self.worker_process}

    def start(self, servers: Sequence[VllmServer]) -> None:
        """Start servers in parallel and stop them when the setup is done."""
        for server in servers:
            self.stack.callback(server.stop)
        self.startup_s.update(start_servers(servers))


@dataclass(frozen=True)
class Setup:
    name: str
    description: str
    start: Callable[[SetupContext], Complete]


def _single(ctx: SetupContext) -> Complete:
    (port,) = free_ports(1)
    # One OpenMP thread on core 1: the P/D servers' model threads run on one core too.
    server = VllmServer("single", port, ctx.vllm, ctx.model_dir, ctx.log_dir,
                        env={"VLLM_CPU_OMP_THREADS_BIND": "1"}, **ctx.server_options())
    ctx.start([server])
    complete(server, prompt_ids(32, seed=99_999), 2)  # warm-up

    def run(prompt: Sequence[int]) -> Sample:
        result = complete(server, prompt, ctx.max_tokens, stream=True)
        if result.ttft_s is None:
            raise RuntimeError(f"no token streamed for a {len(prompt)}-token prompt")
        return Sample(result.token_ids, result.ttft_s)

    return run


def _nixl_xfer_seconds(server: VllmServer) -> tuple[float, float]:
    """(sum, count) of the decode server's `vllm:nixl_xfer_time_seconds` histogram."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    total = count = 0.0
    for line in text.splitlines():
        match = re.match(r"vllm:nixl_xfer_time_seconds_(sum|count)(\{[^}]*\})? (\S+)", line)
        if match:
            if match.group(1) == "sum":
                total += float(match.group(3))
            else:
                count += float(match.group(3))
    return total, count


def _nixl(ctx: SetupContext) -> Complete:
    prefill, decode = nixl_server_pair(ctx.vllm, ctx.model_dir, ctx.log_dir,
                                       **ctx.server_options())
    ctx.start([prefill, decode])
    ctx.notes["warm_up_s"] = round(warm_up_pd(prefill, decode), 3)

    def run(prompt: Sequence[int]) -> Sample:
        before = _nixl_xfer_seconds(decode)
        result = nixl_pd_complete(prefill, decode, prompt, ctx.max_tokens, stream=True)
        after = _nixl_xfer_seconds(decode)
        transfer = (after[0] - before[0]) / (after[1] - before[1]) if after[1] > before[1] \
            else None
        ttft = result.ttft_s
        if ttft is None or result.decode.ttft_s is None:
            raise RuntimeError(f"no token streamed for a {len(prompt)}-token prompt")
        return Sample(result.token_ids, ttft, transfer,
                      {"prefill_s": result.prefill_s, "decode_ttft_s": result.decode.ttft_s})

    return run


def _pd_transfer(ctx: SetupContext) -> Complete:
    pair = pd_transfer_pair(ctx.vllm, ctx.model, ctx.model_dir, ctx.log_dir / "pd_transfer",
                            **ctx.server_options())
    ctx.start([pair.prefill, pair.decode])
    pd_router = Router(RouterSettings(
        host="127.0.0.1", port=0, policy=PolicyName.ROUND_ROBIN,
        prefill=(f"http://127.0.0.1:{pair.prefill.port}@{pair.prefill_bootstrap}",),
        decode=(f"http://127.0.0.1:{pair.decode.port}@{pair.decode_bootstrap}",)))
    ctx.stack.callback(pd_router.close)
    host, port = pd_router.url.removeprefix("http://").split(":")
    router = _Target("router", host, int(port))
    complete(router, prompt_ids(32, seed=99_999), 2)  # warm-up

    def run(prompt: Sequence[int]) -> Sample:
        result = complete(router, prompt, ctx.max_tokens, stream=True)
        ends = [e for e in pair.timeline("decode") if e["event"] == "end"]
        if result.ttft_s is None or not ends:
            raise RuntimeError(f"no token streamed for a {len(prompt)}-token prompt")
        return Sample(result.token_ids, result.ttft_s, ends[-1]["duration_s"])

    return run


@dataclass(frozen=True)
class _Target:
    """What `complete` needs of a server: here the router in front of the engines."""

    role: str
    host: str
    port: int


SETUPS: dict[str, Setup] = {
    "single": Setup("single", "one vLLM instance", _single),
    "nixl": Setup("nixl", "vLLM NixlConnector, prefill + decode servers, sequential proxy",
                  _nixl),
    "pd_transfer": Setup("pd_transfer", "PDTransferConnector, prefill + decode servers, "
                         "pd-transfer router (both at once)", _pd_transfer),
}


def resolve_setup(spec: str) -> Setup:
    """A name from SETUPS, or `package.module:function` (a `(SetupContext) -> Complete`)."""
    if spec in SETUPS:
        return SETUPS[spec]
    if ":" not in spec:
        raise SystemExit(f"unknown setup {spec!r}: one of {sorted(SETUPS)} or module:function")
    module_name, function_name = spec.split(":", 1)
    function = getattr(importlib.import_module(module_name), function_name)
    if isinstance(function, Setup):
        return function
    return Setup(spec, f"{spec} (from --connector)", function)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def run_setup(setup: Setup, ctx: SetupContext, lengths: Sequence[int],
              repeats: int) -> dict[str, Any]:
    started = time.monotonic()
    per_length: dict[str, Any] = {}
    result: dict[str, Any] = {"description": setup.description, "startup_s": ctx.startup_s,
                              "notes": ctx.notes, "lengths": per_length}
    try:
        complete_fn = setup.start(ctx)
    except Exception as exc:  # a setup that cannot serve is a result, not a crash
        result["error"] = f"start-up or warm-up: {type(exc).__name__}: {exc}"
        print(f"[{setup.name}] {result['error']}", flush=True)
        return result
    ready_s = time.monotonic() - started
    result["ready_s"] = round(ready_s, 1)
    print(f"[{setup.name}] servers ready in {ready_s:.0f} s {ctx.startup_s}", flush=True)
    for length in lengths:
        samples = []
        for repeat in range(repeats):
            prompt = prompt_ids(length, seed=1000 * length + repeat)
            try:
                sample = complete_fn(prompt)
            except Exception as exc:
                result["error"] = (f"{length}-token prompt #{repeat}: {type(exc).__name__}: "
                                   f"{exc}")
                print(f"[{setup.name}] {result['error']}", flush=True)
                return result
            samples.append(sample)
            transfer = ("" if sample.kv_transfer_s is None
                        else f", kv transfer {sample.kv_transfer_s * 1000:.1f} ms")
            print(f"[{setup.name}] {length} tokens #{repeat}: TTFT {sample.ttft_s * 1000:.1f} ms"
                  f"{transfer} {sample.parts or ''}", flush=True)
        ttfts = [s.ttft_s for s in samples]
        transfers = [s.kv_transfer_s for s in samples if s.kv_transfer_s is not None]
        per_length[str(length)] = {
            "ttft_p50_s": round(percentile(ttfts, 50), 4),
            "ttft_p99_s": round(percentile(ttfts, 99), 4),
            "kv_transfer_p50_s": round(percentile(transfers, 50), 4) if transfers else None,
            "samples": [{"ttft_s": round(s.ttft_s, 4),
                         "kv_transfer_s": (None if s.kv_transfer_s is None
                                           else round(s.kv_transfer_s, 5)),
                         **{k: round(v, 4) for k, v in s.parts.items()},
                         "token_ids": s.token_ids} for s in samples],
        }
    return result


def compare_tokens(report: dict[str, Any], reference: str) -> None:
    """Mark, per setup and length, how many samples give the reference setup's token ids."""
    ref = report["setups"].get(reference)
    if ref is None:
        return
    for result in report["setups"].values():
        for length, row in result["lengths"].items():
            if length not in ref["lengths"]:
                continue
            ref_samples = ref["lengths"][length]["samples"]
            row["tokens_match_reference"] = sum(
                a["token_ids"] == b["token_ids"]
                for a, b in zip(row["samples"], ref_samples, strict=True))


def print_table(report: dict[str, Any]) -> None:
    print(f"\nTTFT ms (p50 / p99), {report['repeats']} prompts per length; kv = median KV "
          f"transfer ms; match = token ids equal to {report['reference']!r}")
    names = list(report["setups"])
    header = "| tokens | " + " | ".join(names) + " |"
    print(header)
    print("|---:|" + "---:|" * len(names))
    for length in report["lengths"]:
        cells = []
        for name in names:
            row = report["setups"][name]["lengths"].get(str(length))
            if row is None:
                cells.append("did not complete")
                continue
            cell = f"{row['ttft_p50_s'] * 1000:.1f} / {row['ttft_p99_s'] * 1000:.1f}"
            if row["kv_transfer_p50_s"] is not None:
                cell += f" (kv {row['kv_transfer_p50_s'] * 1000:.1f})"
            if "tokens_match_reference" in row:
                cell += f" [{row['tokens_match_reference']}/{report['repeats']}]"
            cells.append(cell)
        print(f"| {length} | " + " | ".join(cells) + " |")
    for name, result in report["setups"].items():
        if "error" in result:
            print(f"{name}: {result['error']}")


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (figures differ by CPU: AMX, AVX-512 BF16)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in lines
                 if line.startswith("model name")), "unknown CPU")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                        help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="prompts per length")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--setups", default="single,nixl,pd_transfer", help=f"of {sorted(SETUPS)}")
    parser.add_argument("--connector", default=None,
                        help="one more setup: a SETUPS name or package.module:function")
    parser.add_argument("--worker-process", action="store_true",
                        help="run each TP-1 engine's model in a worker process (vLLM's CPU "
                             "default) instead of its engine-core process")
    parser.add_argument("--json", type=Path, default=None,
                        help="output (default benchmarks/results/vllm_pd_cpu-<time>.json)")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    specs = [s for s in args.setups.split(",") if s] + ([args.connector] if args.connector
                                                         else [])
    setups = [resolve_setup(spec) for spec in specs]
    vllm = require_vllm_env()
    spec = ModelSpec()
    work = Path(tempfile.mkdtemp(prefix="pd-bench-vllm-"))
    model_dir = spec.write(work / "model", vllm)
    report: dict[str, Any] = {
        "benchmark": "vllm_pd_cpu",
        "host": f"{_cpu_model()}, {platform.machine()}, {os.cpu_count()} cores",
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "vllm": "vllm-cpu 0.32.0 (CPU backend), --enforce-eager, bf16, block 32, "
                f"max-num-batched-tokens {args.max_num_batched_tokens}, prefix caching off, "
                + ("the model in a worker process (vLLM's CPU default)" if args.worker_process
                   else "the model in the engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"),
        "model": {**spec.config(), "kv_bytes_per_token": spec.kv_bytes_per_token()},
        "lengths": lengths,
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "reference": setups[0].name,
        "setups": {},
    }
    for setup in setups:
        with ExitStack() as stack:
            ctx = SetupContext(vllm=vllm, model=spec, model_dir=model_dir, log_dir=work / "logs",
                               stack=stack, max_tokens=args.max_tokens,
                               max_num_batched_tokens=args.max_num_batched_tokens,
                               max_model_len=args.max_model_len,
                               worker_process=args.worker_process)
            report["setups"][setup.name] = run_setup(setup, ctx, lengths, args.repeats)
    compare_tokens(report, setups[0].name)
    print_table(report)
    out = args.json or REPO / "benchmarks" / "results" / (
        f"vllm_pd_cpu-{datetime.now(UTC):%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out} (server logs in {work / 'logs'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
