"""Host time of each call a rank's transfer worker makes, for `benchmarks/worker_calls_gpu.sh`.

Put this directory first on `PYTHONPATH` of `pd-transfer bench transfer` (its rank processes
inherit it) and set `PD_TIME_CALLS` to a file: every call below made on a rank's worker
thread (named `bench-<role>-<rank>`) is timed, and when the worker stops its medians, p90s
and maxima are appended to the file, one block per worker. `PD_SWITCH_INTERVAL` sets the
interpreter's GIL switch interval (seconds) in every process. `PD_PROBE_LAUNCH=1` also starts,
beside each worker, a thread that every ~1 ms launches a one-element kernel on its own
stream twice in a row and times both launches (the first after its wait, the second right
after the first), then does the same with a staging gather (the worker's own Triton kernel,
1K tokens of 16 layers): the same launches in the same process, off the worker.
`PD_EVENT_TIMES` (a file) instead times each gather/scatter the workers enqueue on their
staging stream: its host enqueue, its device time (timing events recorded on that stream
just before and after it) and when it finished as seen from the host (a thread of the
probe's own blocks on each end event in turn: the soonest any worker could know). Finished
minus enqueue end minus device time is how long the kernel waited to run: behind earlier
work on the stream, or for the GPU to switch to this process's context. Not used by the product.
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
    from nixl._api import nixl_agent  # noqa: PLC0415

    from pd_transfer import endpoint  # noqa: PLC0415
    from pd_transfer.decode import arrivals, receiver, scatter  # noqa: PLC0415
    from pd_transfer.kv import staging  # noqa: PLC0415
    from pd_transfer.prefill import parts, posting  # noqa: PLC0415
    from pd_transfer.rank import worker  # noqa: PLC0415
    from pd_transfer.transport import nixl as nixl_transport  # noqa: PLC0415

    for owner, name, label in (
        (parts, "gather", "gather()"),
        (scatter, "prepare_scatter", "prepare_scatter()"),
        (staging.PreparedMove, "launch", "PreparedMove.launch"),
        (staging, "_validate", "staging._validate"),
        (staging, "_layer_ids", "staging._layer_ids"),
        (staging, "prepare_pages", "staging.prepare_pages"),
        (staging.StagingStream, "order", "StagingStream.order"),
        (staging.StagingStream, "record", "StagingStream.record"),
        (staging.PageIds, "select", "PageIds.select"),
        (torch.cuda.Event, "record", "Event.record"),
        (torch.cuda.Event, "query", "Event.query"),
        (endpoint.Endpoint, "step", "Endpoint.step"),
        (parts.PartMaker, "enqueue_gathers", "sender._enqueue_gathers"),
        (arrivals._Arrivals, "on_staged", "receiver._on_staged"),  # the label of earlier results
        (receiver.DecodeReceiver, "_on_message", "receiver._on_message"),
        (posting.Poster, "try_post_staged", "sender._try_post_staged"),
        (endpoint.Endpoint, "seal", "Endpoint.seal"),
        (endpoint.Endpoint, "authenticate", "Endpoint.authenticate"),
        (nixl_transport.NixlTransport, "write", "NixlTransport.write"),
        (nixl_transport.NixlTransport, "poll_messages", "NixlTransport.poll_messages"),
        (nixl_agent, "get_xfer_descs", "nixl.get_xfer_descs"),
        (nixl_agent, "initialize_xfer", "nixl.initialize_xfer"),
        (nixl_agent, "transfer", "nixl.transfer"),
        (nixl_agent, "check_xfer_state", "nixl.check_xfer_state"),
        (nixl_agent, "get_new_notifs", "nixl.get_new_notifs"),
    ):
        _wrap(owner, name, label)
    if staging.TRITON_AVAILABLE:
        from pd_transfer.kv import staging_kernel  # noqa: PLC0415

        _wrap(staging_kernel.Launch, "run", "kernel.launch")
    stop = worker.Worker.stop

    def stop_and_report(self: worker.Worker, *args: Any, **kwargs: Any) -> None:
        _report(path, self._thread.name)
        stop(self, *args, **kwargs)

    worker.Worker.stop = stop_and_report  # type: ignore[method-assign]
    if os.environ.get("PD_PROBE_LAUNCH"):
        start = worker.Worker.start

        def start_with_probe(self: worker.Worker) -> worker.Worker:
            threading.Thread(target=_probe, args=(self,), name="launch-probe",
                             daemon=True).start()
            return start(self)

        worker.Worker.start = start_with_probe  # type: ignore[method-assign]


def _probe(owner: Any) -> None:
    import torch  # noqa: PLC0415

    from pd_transfer.kv import staging  # noqa: PLC0415
    from pd_transfer.kv.layout import KVLayout  # noqa: PLC0415
    from pd_transfer.kv.pool import KVPool  # noqa: PLC0415

    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    one = torch.zeros(1, device="cuda")
    layout = KVLayout(16, 128, 16, 8, 128, torch.bfloat16)
    pool = KVPool.allocate(layout, torch.device("cuda"))
    pages = staging.prepare_pages(pool, list(range(64)))
    out = torch.empty(staging.staged_chunk_bytes(layout, 16, 64, 8), dtype=torch.uint8,
                      device="cuda")

    def gather() -> None:
        staging.gather(pool, range(16), pages, head_start=0, num_heads=8, out=out,
                       stream=stream)

    gather()
    rest = threading.Event()
    while not owner._stop.is_set():
        rest.wait(1e-3)
        with torch.cuda.stream(stream):
            t0 = time.perf_counter()
            one.add_(1)
            t1 = time.perf_counter()
            one.add_(1)
            t2 = time.perf_counter()
        rest.wait(1e-3)
        t3 = time.perf_counter()
        gather()
        t4 = time.perf_counter()
        gather()
        t5 = time.perf_counter()
        _durations.setdefault("probe launch, after 1 ms", []).append(t1 - t0)
        _durations.setdefault("probe launch, right after", []).append(t2 - t1)
        _durations.setdefault("probe gather, after 1 ms", []).append(t4 - t3)
        _durations.setdefault("probe gather, right after", []).append(t5 - t4)


def _install_event_times(path: str) -> None:
    import queue  # noqa: PLC0415 - only when timing is asked for

    import torch  # noqa: PLC0415

    from pd_transfer.kv import staging  # noqa: PLC0415
    from pd_transfer.rank import worker  # noqa: PLC0415

    # label -> [(enqueue start, enqueue end, start event, end event, finished)]
    calls: dict[str, list[list[Any]]] = {}
    ends: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()

    def stamp_finished() -> None:  # the end events of one stream fire in order
        while True:
            row = ends.get()
            row[3].synchronize()
            row[4] = time.perf_counter()

    threading.Thread(target=stamp_finished, name="event-times", daemon=True).start()

    launch = staging.PreparedMove.launch

    @functools.wraps(launch)
    def timed_launch(move: staging.PreparedMove, stream: Any = None) -> int:
        if stream is None:
            return launch(move, stream)
        start, end = (torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                      for _ in range(2))
        t0 = time.perf_counter()
        start.record(stream)
        result = launch(move, stream)
        end.record(stream)
        row = [t0, time.perf_counter(), start, end, None]
        calls.setdefault("scatter" if move.scatter else "gather", []).append(row)
        ends.put(row)
        return result

    staging.PreparedMove.launch = timed_launch  # type: ignore[method-assign, assignment]
    stop = worker.Worker.stop

    def stop_and_report(self: worker.Worker, *args: Any, **kwargs: Any) -> None:
        torch.cuda.synchronize()
        time.sleep(0.1)  # the stamping thread's last rows
        lines = [f"== pid {os.getpid()} {self._thread.name}"]
        for label, made in calls.items():
            rows = [((t1 - t0) * 1e6, start.elapsed_time(end) * 1e3, (done - t1) * 1e6)
                    for t0, t1, start, end, done in made if done is not None]
            for name, column in (("host enqueue", 0), ("device", 1),
                                 ("enqueue end -> finished", 2)):
                ordered = sorted(r[column] for r in rows)
                lines.append(f"  {label:8s} {name:24s} n={len(ordered):5d} "
                             f"med={statistics.median(ordered):8.1f}us "
                             f"p90={ordered[int(0.9 * (len(ordered) - 1))]:8.1f}us")
        with open(path, "a") as out:
            fcntl.flock(out, fcntl.LOCK_EX)
            out.write("\n".join(lines) + "\n")
        stop(self, *args, **kwargs)

    worker.Worker.stop = stop_and_report  # type: ignore[method-assign]


if os.environ.get("PD_TIME_CALLS"):
    _install(os.environ["PD_TIME_CALLS"])
elif os.environ.get("PD_EVENT_TIMES"):
    _install_event_times(os.environ["PD_EVENT_TIMES"])
