"""The reference engine's prefill compute on this CPU: bf16 compute vs float32 compute with a
bf16 KV cache (what the engine runs), same weights, same tokens.

One 2048-token request of `examples/local-reference.yaml`'s model (4 layers, 2 KV heads,
4 query heads, head dim 32), chunked as that example chunks it (256 tokens), through
`ChunkForward` into a paged pool, one thread per process as the engine's pods get on a
small node. Time per request = all chunks and layers, median of ``--runs``. A CPU without
bf16 matrix units (`torch.backends.cpu.get_cpu_capability()` below AVX512_BF16/AMX) runs the
bf16 matmuls on a slow path. Not a test: asserts nothing, but prints how far the two KV
caches differ (bf16 rounding of different float paths).

    .venv/bin/python benchmarks/reference_compute_cpu.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pd_transfer.kv.pipeline import compute_chunk_plan
from pd_transfer.reference.model import ChunkForward, ModelConfig, ReferenceModel

RESULTS = Path(__file__).parent / "results" / "reference_compute_cpu.json"
MODEL = ModelConfig(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                    intermediate_size=256)
PAGE, CHUNK = 16, 256


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _request_seconds(model: ReferenceModel, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    (pool,) = model.allocate_pools(len(ids) // PAGE, PAGE)
    pages = list(range(len(ids) // PAGE))
    started = time.perf_counter()
    for chunk in compute_chunk_plan(len(ids), PAGE, CHUNK):
        forward = ChunkForward(model, ids[chunk.token_start:chunk.token_stop], pools=(pool,),
                               page_table=pages, start_pos=chunk.token_start)
        forward(range(MODEL.num_layers))
    return time.perf_counter() - started, pool.k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ids = torch.randint(0, MODEL.vocab_size, (args.tokens,),
                        generator=torch.Generator().manual_seed(0))
    variants = {"bf16 compute, bf16 KV": ReferenceModel(MODEL, dtype=torch.bfloat16),
                "float32 compute, bf16 KV": ReferenceModel(MODEL, kv_dtype=torch.bfloat16)}
    rows: list[dict[str, Any]] = []
    keys: list[torch.Tensor] = []
    for name, model in variants.items():
        _request_seconds(model, ids)  # warm-up
        times = []
        for _ in range(args.runs):
            seconds, k = _request_seconds(model, ids)
            times.append(seconds)
        keys.append(k)
        rows.append({"variant": name, "median_s": round(statistics.median(times), 4),
                     "runs_s": [round(t, 4) for t in times]})
        print(f"{name:26s} {statistics.median(times) * 1e3:8.1f} ms per {args.tokens}-token "
              f"request (runs: {', '.join(f'{t * 1e3:.0f}' for t in times)})")
    diff = (keys[0].float() - keys[1].float()).abs()
    print(f"K caches differ by at most {diff.max().item():.4f} (mean {diff.mean().item():.5f})")
    result = {"benchmark": "reference_compute_cpu", "cpu": _cpu_model(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "torch": torch.__version__, "threads": 1, "tokens": args.tokens,
              "chunk_tokens": CHUNK, "page_size": PAGE, "model": MODEL.__dict__,
              "results": rows, "k_cache_max_abs_diff": round(diff.max().item(), 5)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
