"""What `pd-transfer router` adds to a request (not a test): latency through the router minus
the same request sent by the client itself, both halves at once, as the router does.

Two measurements in one run:
- `stand-in`: two small HTTP servers that answer at once (the router's tests' stand-in
  engines), so the difference is the router's own cost: parsing, picking, two upstream
  connections, relaying. `--requests` sequential requests each way, interleaved.
- `vllm`: a real vLLM prefill and decode (CPU backend, PDTransferConnector, the tiny model
  of `pd_testbed.vllm.model`), `--repeats` prompts per length each way, interleaved
  (direct, router, direct, ...), each request a new prompt (prefix caching is off anyway).
  The difference there is within vLLM's own run-to-run spread on 2 cores; the figure to
  read is the stand-in one, and this shows it against end-to-end latency.

Run: `.venv/bin/python benchmarks/router_overhead.py [--requests 400] [--repeats 6]`.
Needs the vLLM virtualenv for the second part (`python -m pd_devcluster.vllm_env`).
Writes `benchmarks/results/router_overhead-<time>.json` and prints both tables.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "devtools"))  # pd_testbed

from pd_devcluster.vllm_env import require_vllm_env  # noqa: E402
from pd_testbed.router_engines import StandInEngine, call  # noqa: E402
from pd_testbed.vllm import (  # noqa: E402
    HttpTarget,
    ModelSpec,
    complete,
    pd_transfer_pair,
    pd_transfer_request,
    prompt_ids,
    running,
)
from pd_transfer.router import PolicyName, Router, RouterSettings  # noqa: E402

LENGTHS = (16, 256, 1024)
MAX_TOKENS = 8


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": 1e3 * statistics.median(ordered),
            "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "n": len(ordered)}


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def stand_in(requests: int) -> dict[str, Any]:
    prefill, decode = StandInEngine("prefill"), StandInEngine("decode")
    router = Router(RouterSettings(host="127.0.0.1", port=0, policy=PolicyName.ROUND_ROBIN,
                                   prefill=(prefill.spec("127.0.0.1:1"),),
                                   decode=(decode.spec("127.0.0.1:2"),)))
    body = {"model": "m", "prompt": [5] * 64, "max_tokens": MAX_TOKENS}
    pool = ThreadPoolExecutor(max_workers=1)

    def direct() -> None:  # both halves at once, decode's answer read, as the router does
        half = pool.submit(call, f"http://{prefill.address}", "POST", "/v1/completions",
                           {**body, "max_tokens": 1})
        call(f"http://{decode.address}", "POST", "/v1/completions", body)
        half.result()

    def routed() -> None:
        status, _, _ = call(router.url, "POST", "/v1/completions", body)
        assert status == 200, status

    direct_s, routed_s = [], []
    try:
        for _ in range(20):  # warm-up
            direct()
            routed()
        for _ in range(requests):
            direct_s.append(_timed(direct))
            routed_s.append(_timed(routed))
    finally:
        router.close()
        prefill.close()
        decode.close()
        pool.shutdown()
    return {"direct": _stats(direct_s), "router": _stats(routed_s),
            "overhead_p50_ms": _stats(routed_s)["p50_ms"] - _stats(direct_s)["p50_ms"]}


def real_vllm(repeats: int) -> dict[str, Any]:
    vllm = require_vllm_env()
    root = Path(tempfile.mkdtemp(prefix="pd-bench-router-"))
    spec = ModelSpec()
    model_dir = spec.write(root / "model", vllm)
    pair = pd_transfer_pair(vllm, spec, model_dir, root, max_num_batched_tokens=256)
    out: dict[str, Any] = {}
    with running([pair.prefill, pair.decode]):
        router = Router(RouterSettings(
            host="127.0.0.1", port=0, policy=PolicyName.ROUND_ROBIN,
            prefill=(f"http://127.0.0.1:{pair.prefill.port}@{pair.prefill_bootstrap}",),
            decode=(f"http://127.0.0.1:{pair.decode.port}@{pair.decode_bootstrap}",)))
        host, port = router.url.removeprefix("http://").split(":")
        target = HttpTarget("router", host, int(port))
        try:
            def direct(prompt: list[int]) -> None:
                pd_transfer_request(prompt, MAX_TOKENS, room=uuid.uuid4().hex,
                                    prefill=pair.prefill_bootstrap,
                                    decode=pair.decode_bootstrap,
                                    prefill_server=pair.prefill, decode_server=pair.decode)

            for _ in range(2):  # warm-up: the first transfer connects the pods
                direct(prompt_ids(64, seed=1))
                complete(target, prompt_ids(64, seed=2), MAX_TOKENS)
            for length in LENGTHS:
                direct_s, routed_s = [], []
                for i in range(repeats):
                    one = prompt_ids(length, seed=10_000 + 2 * i + length)
                    two = prompt_ids(length, seed=10_001 + 2 * i + length)
                    direct_s.append(_timed(functools.partial(direct, one)))
                    routed_s.append(_timed(functools.partial(complete, target, two,
                                                             MAX_TOKENS)))
                out[str(length)] = {"direct": _stats(direct_s), "router": _stats(routed_s),
                                    "overhead_p50_ms": _stats(routed_s)["p50_ms"]
                                    - _stats(direct_s)["p50_ms"]}
                print(f"  vllm {length:>5} tokens: {out[str(length)]}", flush=True)
        finally:
            router.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "benchmark": "router_overhead",
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "max_tokens": MAX_TOKENS,
    }
    print("stand-in engines (answer at once):", flush=True)
    report["stand_in"] = stand_in(args.requests)
    print(f"  {report['stand_in']}", flush=True)
    if not args.skip_vllm:
        print("real vLLM prefill + decode (PDTransferConnector):", flush=True)
        report["vllm"] = real_vllm(args.repeats)
    results = REPO / "benchmarks" / "results"
    path = results / f"router_overhead-{datetime.now(UTC):%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
