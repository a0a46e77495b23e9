"""The thread that drives one endpoint: ``step`` in a loop, sleeping a little when idle.

One worker per rank owns the endpoint and its transport (which is not thread-safe). It
never dies from one request's error (the endpoint isolates those, docs/failure-modes.md #12); an
unexpected error of the loop itself is logged and the loop goes on after a short pause.
It never exits the process.

Sleeping: after a step that did nothing, the worker waits on the endpoint's ``wakeup``
event, backing off from 50 µs to ``max_idle_sleep_s`` so several ranks can share two cores
(NIXL runs without a progress thread: see docs/testbed.md). An engine command (``submit``)
sets ``wakeup``, so a command never waits for a sleep to end. What a peer sends and what the
GPU finishes can only be polled: the endpoint caps the sleep while its requests move data
(``Endpoint.poll_interval_s``: on CUDA ~20 µs while a part is in flight, 200 µs while a
request waits for its peer; on CPU no cap), since every wait of a step on the way (a grant,
a notification, a gather's or scatter's event) would otherwise cost up to a whole sleep.
The kernel ends such a wait up to its timer slack late (50 µs by default); ``timer_slack_ns``
sets the worker thread's own (Linux), which benchmarks compare (benchmarks/README.md,
"Settings of the rank processes").
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from typing import Protocol

__all__ = ["Steppable", "Worker", "set_thread_timer_slack"]

_log = logging.getLogger("pd_transfer")
MIN_IDLE_SLEEP_S = 50e-6
_PR_SET_TIMERSLACK = 29  # <linux/prctl.h>


def set_thread_timer_slack(slack_ns: int) -> bool:
    """Set the calling thread's timer slack (Linux ``prctl(PR_SET_TIMERSLACK)``): how late
    the kernel may end its timed waits to batch wake-ups (default 50 µs, which turns a
    20 µs poll into ~70 µs). False where the platform has no such setting."""
    if slack_ns <= 0:
        raise ValueError(f"timer slack must be positive (ns), got {slack_ns}")
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(slack_ns), 0, 0, 0) != 0:
        _log.warning("prctl(PR_SET_TIMERSLACK, %d) failed: errno %d", slack_ns,
                     ctypes.get_errno())
        return False
    return True


class Steppable(Protocol):
    @property
    def wakeup(self) -> threading.Event:
        """Set when work arrives that a sleeping worker should start at once."""
        ...

    def thread_started(self) -> None:
        """Called once on the worker's thread, before its first step."""
        ...

    def step(self) -> bool: ...

    def poll_interval_s(self) -> float | None:
        """The longest the worker may sleep now (None: ``max_idle_sleep_s``)."""
        ...

    def close(self) -> None: ...


class Worker:
    """Runs ``endpoint.step()`` on a daemon thread until ``stop``."""

    def __init__(
        self, endpoint: Steppable, name: str = "pd-transfer", max_idle_sleep_s: float = 0.001,
        *, timer_slack_ns: int | None = None,
    ) -> None:
        if timer_slack_ns is not None and timer_slack_ns <= 0:
            raise ValueError(f"timer_slack_ns must be positive, got {timer_slack_ns}")
        self.endpoint = endpoint
        self.max_idle_sleep_s = max_idle_sleep_s
        self.timer_slack_ns = timer_slack_ns
        self.loop_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Worker:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0, *, close: bool = True) -> None:
        """Stop the loop; then (on this thread, the worker being gone) close the endpoint."""
        self._stop.set()
        self.endpoint.wakeup.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            _log.error("worker %s did not stop within %s s", self._thread.name, timeout_s)
            return
        if close:
            self.endpoint.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        sleep_s = 0.0
        wakeup = self.endpoint.wakeup
        if self.timer_slack_ns is not None:
            set_thread_timer_slack(self.timer_slack_ns)
        try:
            self.endpoint.thread_started()
        except Exception:  # the loop still runs: its requests fail or time out, not hang
            self.loop_errors += 1
            _log.exception("transfer worker %s could not set up its thread",
                           threading.current_thread().name)
        while not self._stop.is_set():
            try:
                busy = self.endpoint.step()
                cap = self.endpoint.poll_interval_s()
            except Exception:
                self.loop_errors += 1
                _log.exception("transfer worker loop error (the worker keeps serving)")
                busy, cap = False, None
                sleep_s = self.max_idle_sleep_s
            if busy:
                sleep_s = 0.0
                continue
            limit = self.max_idle_sleep_s if cap is None else min(cap, self.max_idle_sleep_s)
            sleep_s = min(max(sleep_s * 2, MIN_IDLE_SLEEP_S), limit)
            if wakeup.wait(sleep_s):
                wakeup.clear()
