"""SGLang 0.5.23's disaggregation metrics (NIXL and Mooncake backends), mapped onto a
TransferAgent status.

Source: ``sglang/srt/observability/metrics_collector.py`` (``SchedulerMetricsCollector``) of
PyPI ``sglang`` 0.5.23, and where the scheduler feeds it: ``disaggregation/prefill.py``,
``disaggregation/decode.py``, ``observability/req_time_stats.py``,
``managers/scheduler_components/metrics_reporter.py``; the test data
(``tests/unit/data/sglang_0.5.23_*.prom``) is exposition text that class produced. SGLang
serves them at ``/metrics`` on its HTTP port only with ``--enable-metrics``, through
prometheus_client's multiprocess collector: a labelled metric appears with its first
observation (``Presence.ON_FIRST_EVENT``: absent means nothing happened yet), there is no
process start time, and labels are ``model_name``, ``engine_type`` (prefill/decode),
``tp_rank``, ``pp_rank``, ``moe_ep_rank`` (and ``dp_rank``, ``priority`` when enabled; only
attention-TP rank 0 reports by default). Queue gauges carry a per-priority breakdown beside
the total (``priority=""``) when priority scheduling is on: only the total is read.

SGLang pushes: the prefill sends the KV, so the prefill times and sizes transfers; both
sides count the requests they fail.

- ``sglang:per_stage_req_latency_seconds{stage="prefill_transfer_kv_cache"}`` (histogram,
  prefill): SUCCEEDED (its count): a request's KV was sent (poll Success);
- ``sglang:kv_transfer_latency_ms`` (histogram, prefill): TRANSFER_TIME (ms → s);
- ``sglang:kv_transfer_total_mb`` (histogram, prefill): BYTES (its sum, MiB → bytes);
- ``sglang:per_stage_req_latency_seconds{stage="decode_transferred"}`` (histogram, decode):
  SUCCEEDED (its count): a request's KV arrived;
- ``sglang:num_transfer_failed_reqs_total`` (counter, both): FAILED ``TransferFailed``: a
  request failed during its KV transfer (the client gets HTTP 500);
- ``sglang:num_bootstrap_failed_reqs_total`` (counter, both): FAILED ``BootstrapFailed``: a
  request failed to bootstrap with its peer (HTTP 500);
- gauges, QUEUE: ``sglang:num_prefill_bootstrap_queue_reqs`` (``prefillBootstrap``: waiting
  for their decode), ``sglang:num_prefill_inflight_queue_reqs`` (``prefillInflight``, in
  flight: KV being sent), ``sglang:num_decode_prealloc_queue_reqs`` (``decodePrealloc``:
  waiting for KV memory), ``sglang:num_decode_transfer_queue_reqs`` (``decodeTransfer``, in
  flight: KV arriving).

The queue gauges are written in one call with ``sglang:num_running_reqs`` (every stats log,
at least every 30 s when idle): missing while that one is there is a mapping error.
Not mapped: ``sglang:kv_transfer_speed_gb_s`` (derived from the two above),
``kv_transfer_bootstrap_ms`` / ``kv_transfer_alloc_ms`` (bootstrap, not transfer),
``num_prefill_retries_total``. Unknown on the decode: bytes and transfer time (the decode's
per-stage time includes waiting for the prefill's forward pass, so it is not used).
"""

from __future__ import annotations

from typing import Final

from pd_transfer.native.mapping import (
    EngineMapping,
    Kind,
    Meaning,
    MetricSpec,
    Presence,
    RoleName,
)

__all__ = ["SGLANG_0_5_23"]

_DECODE: Final[frozenset[RoleName]] = frozenset({"decode"})
_PREFILL: Final[frozenset[RoleName]] = frozenset({"prefill"})
_BOTH: Final[frozenset[RoleName]] = frozenset({"prefill", "decode"})
_EVENT: Final = Presence.ON_FIRST_EVENT
_STAGES: Final = "sglang:per_stage_req_latency_seconds"
_LOGGED_WITH: Final = "sglang:num_running_reqs"
_TOTAL: Final = (("priority", ""),)
MIB: Final = 1024.0 * 1024.0

SGLANG_0_5_23: Final = EngineMapping(
    engine="sglang",
    version="0.5.23",
    connector="NIXL/Mooncake transfer backend",
    start_time_family=None,
    anchor="sglang:",
    missing_hint="SGLang serves metrics at /metrics on its HTTP port only when started with "
    "--enable-metrics",
    metrics=(
        MetricSpec(_STAGES, Kind.HISTOGRAM, Meaning.SUCCEEDED, _PREFILL,
                   "requests whose KV was sent", labels=(("stage", "prefill_transfer_kv_cache"),),
                   presence=_EVENT),
        MetricSpec("sglang:kv_transfer_latency_ms", Kind.HISTOGRAM, Meaning.TRANSFER_TIME,
                   _PREFILL, "KV cache transfer latency", scale=0.001, presence=_EVENT),
        MetricSpec("sglang:kv_transfer_total_mb", Kind.HISTOGRAM, Meaning.BYTES, _PREFILL,
                   "KV cache transfer size", scale=MIB, presence=_EVENT),
        MetricSpec(_STAGES, Kind.HISTOGRAM, Meaning.SUCCEEDED, _DECODE,
                   "requests whose KV arrived", labels=(("stage", "decode_transferred"),),
                   presence=_EVENT),
        MetricSpec("sglang:num_transfer_failed_reqs", Kind.COUNTER, Meaning.FAILED, _BOTH,
                   "requests failed in their KV transfer", reason="TransferFailed",
                   presence=_EVENT),
        MetricSpec("sglang:num_bootstrap_failed_reqs", Kind.COUNTER, Meaning.FAILED, _BOTH,
                   "requests failed to bootstrap with their peer", reason="BootstrapFailed",
                   presence=_EVENT),
        MetricSpec("sglang:num_prefill_bootstrap_queue_reqs", Kind.GAUGE, Meaning.QUEUE,
                   _PREFILL, "requests in the prefill bootstrap queue", labels=_TOTAL,
                   queue="prefillBootstrap", presence=_EVENT, with_family=_LOGGED_WITH),
        MetricSpec("sglang:num_prefill_inflight_queue_reqs", Kind.GAUGE, Meaning.QUEUE,
                   _PREFILL, "requests in the prefill inflight (sending) queue", labels=_TOTAL,
                   queue="prefillInflight", in_flight=True, presence=_EVENT,
                   with_family=_LOGGED_WITH),
        MetricSpec("sglang:num_decode_prealloc_queue_reqs", Kind.GAUGE, Meaning.QUEUE,
                   _DECODE, "requests in the decode prealloc queue", labels=_TOTAL,
                   queue="decodePrealloc", presence=_EVENT, with_family=_LOGGED_WITH),
        MetricSpec("sglang:num_decode_transfer_queue_reqs", Kind.GAUGE, Meaning.QUEUE,
                   _DECODE, "requests in the decode transfer queue", labels=_TOTAL,
                   queue="decodeTransfer", in_flight=True, presence=_EVENT,
                   with_family=_LOGGED_WITH),
    ),
)
