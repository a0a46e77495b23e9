"""Produce SGLang 0.5.23 `/metrics` text with SGLang's own metrics collector.

Not a test, and not run by the test suite: SGLang cannot serve on these machines (PyPI
`sglang` has no CPU build: its kernels are CUDA only), so the engine-native agent's SGLang
mapping (`pd_transfer/native/sglang.py`) is tested against exposition text made by
SGLang 0.5.23's own `SchedulerMetricsCollector` (sglang/srt/observability/
metrics_collector.py), instantiated the way SGLang's scheduler does (`init_new`, labels
from a published runtime context) and exposed the way SGLang's HTTP server does
(prometheus_client multiprocess mode: `PROMETHEUS_MULTIPROC_DIR`, `MultiProcessCollector`,
`generate_latest`). The events are fed through the collector's own methods, in the order
SGLang's disaggregation code calls them (`disaggregation/prefill.py`, `decode.py`,
`observability/req_time_stats.py`); their values are this script's (`SCENARIOS`).

How to run it, from the repository's root (SGLang's package imports torch and transformers; the
cached vLLM virtualenv, built by `python -m pd_devcluster.vllm_env`, has both in CPU
builds; `devtools/` on the path for the test bed):

    pip download sglang==0.5.23 --no-deps -d SGL && unzip -q SGL/sglang-0.5.23-*.whl -d SGL/pkg
    pip install --no-deps --target SGL/extra orjson ipython traitlets gguf
    PYTHONPATH=SGL/pkg:SGL/extra:devtools <vLLM venv>/bin/python \\
        -m pd_testbed.captures.sglang_metrics [OUT_DIR]

(OUT_DIR: `tests/unit/data` by default; `SGL/extra` holds SGLang's own imports the vLLM env
lacks.) `torchvision` is replaced by an empty module for the import: SGLang's multimodal
config helpers import it, and the CPU torchvision build breaks imports (`torchvision::nms`
missing); nothing of it is used here. Each scenario runs in a fresh child process (a
collector registers its metrics once per process, and each scenario needs its own
multiprocess directory).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pd_testbed.checkout import UNIT_DATA_DIR
from pd_testbed.exposition_text import trim

SGLANG_VERSION = "0.5.23"
# Families kept in the captures (the mapping's, and what they are logged with).
KEEP = ("sglang:num_running_reqs", "sglang:num_prefill_bootstrap_queue_reqs",
        "sglang:num_prefill_inflight_queue_reqs", "sglang:num_decode_prealloc_queue_reqs",
        "sglang:num_decode_transfer_queue_reqs", "sglang:kv_transfer_latency_ms",
        "sglang:kv_transfer_total_mb", "sglang:kv_transfer_speed_gb_s",
        "sglang:num_transfer_failed_reqs", "sglang:num_bootstrap_failed_reqs",
        "sglang:per_stage_req_latency_seconds")
MIB = 1024 * 1024
# Per sent request (prefill): transfer latency in ms and size in MiB (SGLang's "MB").
PREFILL_TRANSFERS = ((8.0, 1.5), (12.0, 1.5), (30.0, 3.0), (45.0, 3.0), (120.0, 6.0))
# Per arrived request (decode): seconds in the decode transfer queue.
DECODE_ARRIVALS = (0.05, 0.08, 0.2, 0.3)


class _EmptyModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`torchvision.*` as empty modules whose every attribute is an empty class."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__file__ = "<empty>"
        module.__version__ = "0.0.0"  # type: ignore[attr-defined]
        module.__getattr__ = _anything  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Anything(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


def _anything(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Anything(name, (), {})


def _collector(role: str, model_dir: Path) -> Any:
    """SGLang's scheduler collector for a `role` server, as `init_new` makes it."""
    from sglang.srt import runtime_context  # noqa: PLC0415 - after the env is set
    from sglang.srt.observability.metrics_collector import (  # noqa: PLC0415
        SchedulerMetricsCollector,
    )
    from sglang.srt.server_args import ServerArgs  # noqa: PLC0415

    args = ServerArgs(model_path=str(model_dir), served_model_name="tiny-llama",
                      disaggregation_mode=role, enable_metrics=True, device="cpu")
    runtime_context.publish(args, role="scheduler")
    ranks = {"tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0, "attn_tp_rank": 0,
             "attn_cp_rank": 0, "dp_rank": None}
    with runtime_context.get_parallel().override(**ranks):
        context = SchedulerMetricsCollector.init_new(
            server_args=args, enable_priority_scheduling=False, enable_lora=False,
            enable_hierarchical_cache=False)
    assert context.collector is not None
    return context.collector


def _log_queues(collector: Any, **depths: int) -> None:
    """One scheduler stats log (`metrics_reporter`: every batch, or every 30 s idle)."""
    from sglang.srt.observability.metrics_collector import (  # noqa: PLC0415
        QueueCount,
        SchedulerStats,
    )

    stats = SchedulerStats()
    for name, depth in depths.items():
        setattr(stats, name, QueueCount(total=depth))
    collector.log_stats(stats)


def _prefill_sent(collector: Any) -> None:
    from sglang.srt.observability.req_time_stats import RequestStage  # noqa: PLC0415

    for latency_ms, size_mib in PREFILL_TRANSFERS:
        # prefill.py: poll Success → set_prefill_kv_transfer_finish_time (per-stage), then
        # compute_and_observe_kv_transfer_metrics (latency, size, speed; bootstrap, alloc).
        collector.observe_per_stage_req_latency(
            RequestStage.PREFILL_TRANSFER_KV_CACHE.stage_name, latency_ms / 1000 + 0.002)
        collector.observe_kv_transfer_metrics(
            latency_ms=latency_ms, total_mb=size_mib,
            speed_gb_s=(size_mib / 1024) / (latency_ms / 1000))
        collector.observe_kv_transfer_bootstrap(bootstrap_ms=3.0, alloc_ms=1.0)


def _decode_arrived(collector: Any) -> None:
    from sglang.srt.observability.req_time_stats import RequestStage  # noqa: PLC0415

    for seconds in DECODE_ARRIVALS:
        # decode.py: KV arrived → set_wait_queue_entry_time (DECODE_TRANSFERRED).
        collector.observe_per_stage_req_latency(RequestStage.DECODE_TRANSFERRED.stage_name,
                                                seconds)


def _fail(collector: Any, transfer: int, bootstrap: int) -> None:
    for _ in range(transfer):
        collector.increment_transfer_failed_reqs()
    for _ in range(bootstrap):
        collector.increment_bootstrap_failed_reqs()


def _prefill_busy(collector: Any, *, transfer: int, bootstrap: int) -> None:
    """An idle stats log, the sent requests, the failures, then a log of busy queues."""
    _log_queues(collector)
    _prefill_sent(collector)
    _fail(collector, transfer, bootstrap)
    _log_queues(collector, num_prefill_bootstrap_queue_reqs=2, num_prefill_inflight_queue_reqs=1)


def _decode_busy(collector: Any, *, transfer: int, bootstrap: int) -> None:
    """An idle stats log, the arrivals, the failures, then a log of busy queues."""
    _log_queues(collector)
    _decode_arrived(collector)
    _fail(collector, transfer, bootstrap)
    _log_queues(collector, num_decode_prealloc_queue_reqs=3, num_decode_transfer_queue_reqs=2)


Scenario = tuple[str, str, str, Callable[[Any], None]]
SCENARIOS: tuple[Scenario, ...] = (
    ("prefill_idle", "prefill", "after its first (idle) stats log, no request yet",
     _log_queues),
    ("prefill_healthy", "prefill",
     f"{len(PREFILL_TRANSFERS)} requests' KV sent (latency ms, MiB: {PREFILL_TRANSFERS}); "
     "queues: 2 waiting for bootstrap, 1 sending",
     lambda c: _prefill_busy(c, transfer=0, bootstrap=0)),
    ("prefill_failing", "prefill",
     "the healthy scenario's events, then 3 requests failed in transfer and 1 in bootstrap",
     lambda c: _prefill_busy(c, transfer=3, bootstrap=1)),
    ("decode_idle", "decode", "after its first (idle) stats log, no request yet",
     _log_queues),
    ("decode_healthy", "decode",
     f"{len(DECODE_ARRIVALS)} requests' KV arrived (seconds in the transfer queue: "
     f"{DECODE_ARRIVALS}); queues: 3 waiting for KV memory, 2 receiving",
     lambda c: _decode_busy(c, transfer=0, bootstrap=0)),
    ("decode_failing", "decode",
     "the healthy scenario's events, then 2 requests failed in transfer and 4 in bootstrap",
     lambda c: _decode_busy(c, transfer=2, bootstrap=4)),
)


def run_scenario(name: str, out: Path) -> None:
    """In this (fresh) process: one scenario's exposition text into `out`."""
    sys.meta_path.insert(0, _EmptyModule())
    from prometheus_client import (  # noqa: PLC0415 - after PROMETHEUS_MULTIPROC_DIR
        CollectorRegistry,
        generate_latest,
        multiprocess,
    )

    _, role, what, feed = next(s for s in SCENARIOS if s[0] == name)
    model_dir = Path(tempfile.mkdtemp(prefix="sglang-model-"))
    (model_dir / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,'
        ' "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,'
        ' "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096,'
        ' "torch_dtype": "bfloat16"}')
    feed(_collector(role, model_dir))
    registry = CollectorRegistry()
    # As sglang's add_prometheus_middleware (prometheus_client leaves this one untyped).
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    text = generate_latest(registry).decode()
    header = [
        f"# SGLang {SGLANG_VERSION} (PyPI sglang {SGLANG_VERSION}), {role} server "
        "(--disaggregation-mode " + role + " --enable-metrics):",
        *textwrap.wrap(what + ".", 88, initial_indent="#   ", subsequent_indent="#   "),
        "# Produced by SGLang's own SchedulerMetricsCollector (init_new) in prometheus_client",
        "# multiprocess mode, exposed like SGLang's /metrics, by",
        f"# devtools/pd_testbed/captures/sglang_metrics.py on {time.strftime('%Y-%m-%d')}"
        " (see its",
        "# docstring: SGLang cannot run on these CPU-only machines). Trimmed to KEEP.",
    ]
    (out / f"sglang_{SGLANG_VERSION}_{name}.prom").write_text("\n".join(header) + "\n"
                                                             + trim(text, KEEP))


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["--scenario"]:
        run_scenario(argv[1], Path(argv[2]))
        return 0
    out = Path(argv[0]) if argv else UNIT_DATA_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name, *_ in SCENARIOS:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="sgl-prom-")}
        subprocess.run([sys.executable, "-m", __spec__.name, "--scenario", name, str(out)],
                       env=env, check=True, timeout=600)
        print(f"wrote {out}/sglang_{SGLANG_VERSION}_{name}.prom")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
