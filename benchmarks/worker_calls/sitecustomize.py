"""Host time of each call a rank's transfer worker makes, for `benchmarks/worker_calls_gpu.sh`.

Put this directory first on `PYTHONPATH` of `pd-transfer bench transfer` (its rank processes
inherit it) and set `PD_TIME_CALLS` to a file: every call below made on a rank's worker
thread (named `bench-<role>-<rank>`) is timed, and when the worker stops its medians, p90s
and maxima are appended to the file, one block per worker. `PD_SWITCH_INTERVAL` sets the
interpreter's GIL switch interval (seconds) in every process. Not used by the product.
"""

from __future__ import annotations

import fcntl
import functools
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

if os.environ.get("PD_SWITCH_INTERVAL"):
    sys.setswitchinterval(float(os.environ["PD_SWITCH_INTERVAL"]))

_durations: dict[str, list[float]] = {}


def _wrap(owner: Any, name: str, label: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if not threading.current_thread().name.startswith("bench-"):
            return original(*args, **kwargs)
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _durations.setdefault(label, []).append(time.perf_counter() - started)

    setattr(owner, name, timed)


def _report(path: str, worker_name: str) -> None:
    lines = [f"== pid {os.getpid()} {worker_name}"]
    for label, durations in sorted(_durations.items()):
        ordered = sorted(durations)
        lines.append(f"  {label:28s} n={len(ordered):6d} "
                     f"med={statistics.median(ordered) * 1e6:8.1f}us "
                     f"p90={ordered[int(0.9 * (len(ordered) - 1))] * 1e6:8.1f}us "
                     f"max={ordered[-1] * 1e6:9.1f}us")
    with open(path, "a") as out:
        fcntl.flock(out, fcntl.LOCK_EX)
        out.write("\n".join(lines) + "\n")


def _install(path: str) -> None:
    import torch  # noqa: PLC0415 - only when timing is asked for

    from pd_transfer import _endpoint, receiver, sender, staging, worker  # noqa: PLC0415

    for owner, name, label in (
        (sender, "gather", "gather()"),
        (receiver, "scatter", "scatter()"),
        (staging, "_validate", "staging._validate"),
        (staging, "_layer_ids", "staging._layer_ids"),
        (staging, "prepare_pages", "staging.prepare_pages"),
        (staging.StagingStream, "order", "StagingStream.order"),
        (staging.StagingStream, "record", "StagingStream.record"),
        (staging.PageIds, "select", "PageIds.select"),
        (torch.cuda.Event, "record", "Event.record"),
        (torch.cuda.Event, "query", "Event.query"),
        (_endpoint.Endpoint, "step", "Endpoint.step"),
        (sender.PrefillSender, "_enqueue_gathers", "sender._enqueue_gathers"),
        (receiver.DecodeReceiver, "_on_staged", "receiver._on_staged"),
    ):
        _wrap(owner, name, label)
    if staging.TRITON_AVAILABLE:
        from pd_transfer import _staging_kernel  # noqa: PLC0415

        _wrap(_staging_kernel, "launch", "kernel.launch")
    stop = worker.Worker.stop

    def stop_and_report(self: worker.Worker, *args: Any, **kwargs: Any) -> None:
        _report(path, self._thread.name)
        stop(self, *args, **kwargs)

    worker.Worker.stop = stop_and_report  # type: ignore[method-assign]


if os.environ.get("PD_TIME_CALLS"):
    _install(os.environ["PD_TIME_CALLS"])
