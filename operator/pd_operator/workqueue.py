"""A coalescing work queue of PDDeployment keys, in the manner of client-go's workqueue.

Contract:
- `add(key)` makes the key due now. A key is queued at most once (duplicates coalesce), and
  at most one worker processes a key at a time; a key added while it is being processed is
  processed once more right after (so no event is lost, and none is handled twice in
  parallel).
- After the work function returns True the key is re-queued after `resync_s` (a periodic
  level check that does not depend on watch events); `RecheckAfter(s)` re-queues it after
  `min(s, resync_s)` (something will change with time alone, e.g. a report turning stale);
  False forgets the key (object gone).
- `add_throttled(key, min_interval_s)` is for triggers that only refresh status (agent
  reports, the operator's own status writes): the key becomes due no sooner than
  `min_interval_s` after its previous processing started, so N reports in that interval
  cost one reconcile (and at most one status write), not N. A key already due now absorbs
  it. Returns False when the trigger was folded into a pending run.
- `LeadershipLost` drops the key: this replica stopped leading, and the next term queues
  every PDDeployment anyway.
- `ConflictError` re-queues after `conflict_delay_s` (someone wrote first: re-read soon) and
  does not count as a failure. Any other exception re-queues after an exponential backoff,
  `base_backoff_s * 2**(failures-1)` capped at `max_backoff_s`; the work function is told
  how many consecutive failures preceded this attempt, so it can report Degraded after a
  few. Success resets the count.
- At most one delayed add is pending per key; an earlier due time replaces a later one.
Everything runs on one asyncio loop; the work itself may run in threads (the reconcile uses
the synchronous Kubernetes client).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from pd_operator.errors import ConflictError, LeadershipLost, OperatorError, PermanentError
from pd_operator.metrics import WORKQUEUE_DEPTH

__all__ = ["QueueTuning", "RecheckAfter", "WorkQueue"]

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class QueueTuning:
    """Timing of the queue; defaults suit a production operator."""

    workers: int = 4
    resync_s: float = 300.0
    conflict_delay_s: float = 0.1
    base_backoff_s: float = 0.5
    max_backoff_s: float = 300.0
    # Least time between two status-only reconciles of one PDDeployment (`add_throttled`):
    # 64 agents reporting every 10 s would otherwise cost ~6 status writes a second.
    status_interval_s: float = 5.0

    def backoff_s(self, failures: int) -> float:
        """Delay after the `failures`-th consecutive failure (1-based)."""
        return float(min(self.base_backoff_s * 2 ** max(failures - 1, 0), self.max_backoff_s))


@dataclass(frozen=True)
class RecheckAfter:
    """Work result: keep the key and process it again after `seconds` (capped at resync)."""

    seconds: float


class WorkQueue(Generic[K]):
    """See the module docstring. `work(key, failures_so_far) -> keep_resyncing`."""

    def __init__(
        self,
        work: Callable[[K, int], Awaitable[bool | RecheckAfter]],
        tuning: QueueTuning | None = None,
    ) -> None:
        self._work = work
        self.tuning = tuning or QueueTuning()
        self._queue: deque[K] = deque()
        self._queued: set[K] = set()
        self._processing: set[K] = set()
        self._dirty: set[K] = set()
        self._timers: dict[K, tuple[float, asyncio.TimerHandle]] = {}
        self._failures: dict[K, int] = {}
        self._started: dict[K, float] = {}
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._workers: list[asyncio.Task[None]] = []

    # -- feeding ---------------------------------------------------------------------------

    def add(self, key: K) -> None:
        """Make `key` due now (coalesced with a queued or in-flight one)."""
        if key in self._processing:
            self._dirty.add(key)
            return
        if key in self._queued:
            return
        self._queued.add(key)
        self._queue.append(key)
        self._idle.clear()
        WORKQUEUE_DEPTH.set(len(self._queue))
        self._wakeup.set()

    def add_after(self, key: K, delay_s: float) -> None:
        """Make `key` due after `delay_s`, unless it is already due earlier."""
        loop = asyncio.get_running_loop()
        due = loop.time() + delay_s
        pending = self._timers.get(key)
        if pending is not None:
            if pending[0] <= due:
                return
            pending[1].cancel()
        handle = loop.call_later(delay_s, self._fire, key)
        self._timers[key] = (due, handle)

    def add_throttled(self, key: K, min_interval_s: float | None = None) -> bool:
        """Make `key` due at least `min_interval_s` (default `status_interval_s`) after its
        previous processing started; False when folded into a run that is already due."""
        interval = self.tuning.status_interval_s if min_interval_s is None else min_interval_s
        if key in self._queued:
            return False
        loop = asyncio.get_running_loop()
        last = self._started.get(key)
        wait = 0.0 if last is None else last + interval - loop.time()
        if wait <= 0 and key not in self._processing:
            self.add(key)
            return True
        pending = self._timers.get(key)
        # A timer due no later than this trigger's time absorbs it (1 ms for float noise).
        folded = pending is not None and pending[0] <= loop.time() + max(wait, 0.0) + 1e-3
        self.add_after(key, max(wait, 0.0))
        return not folded

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def forget(self, key: K) -> None:
        """Drop the delayed add and failure count of `key` (its object is gone)."""
        pending = self._timers.pop(key, None)
        if pending is not None:
            pending[1].cancel()
        self._failures.pop(key, None)
        self._started.pop(key, None)

    # -- introspection -----------------------------------------------------------------------

    @property
    def depth(self) -> int:
        return len(self._queue)

    def failures(self, key: K) -> int:
        return self._failures.get(key, 0)

    def delayed(self, key: K) -> float | None:
        """Seconds until the delayed add of `key`, or None."""
        pending = self._timers.get(key)
        return None if pending is None else pending[0] - asyncio.get_running_loop().time()

    async def wait_idle(self) -> None:
        """Until nothing is queued or in flight (delayed adds do not count)."""
        await self._idle.wait()

    def health(self) -> str | None:
        """None while every started worker runs; else which ended (they end only when
        cancelled by `stop`, which forgets them)."""
        ended = [t.get_name() for t in self._workers if t.done()]
        return f"work queue workers ended: {', '.join(ended)}" if ended else None

    # -- running -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers on the running loop."""
        if self._workers:
            return
        self._workers = [
            asyncio.create_task(self._worker(), name=f"pd-operator-worker-{i}")
            for i in range(self.tuning.workers)
        ]

    async def stop(self) -> None:
        """Cancel workers and delayed adds; in-flight thread work finishes on its own."""
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []

    async def _next(self) -> K:
        while not self._queue:
            self._wakeup.clear()
            await self._wakeup.wait()
        key = self._queue.popleft()
        self._queued.discard(key)
        WORKQUEUE_DEPTH.set(len(self._queue))
        return key

    async def _worker(self) -> None:
        while True:
            key = await self._next()
            self._processing.add(key)
            self._started[key] = asyncio.get_running_loop().time()
            try:
                await self._process(key)
            finally:
                self._processing.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.add(key)
                if not self._queue and not self._processing:
                    self._idle.set()

    async def _process(self, key: K) -> None:
        failures = self._failures.get(key, 0)
        try:
            keep = await self._work(key, failures)
        except asyncio.CancelledError:
            raise
        except LeadershipLost as exc:
            log.info("%s: reconcile stopped, %s", key, exc)
        except ConflictError as exc:
            log.info("%s: conflict, retrying in %.1f s: %s", key,
                     self.tuning.conflict_delay_s, exc)
            self.add_after(key, self.tuning.conflict_delay_s)
        except Exception as exc:
            # One key's failure must never stop the worker: it is logged and retried later;
            # errors the operator did not anticipate are logged with their traceback.
            failures += 1
            self._failures[key] = failures
            delay = self.tuning.backoff_s(failures)
            level = logging.ERROR if isinstance(exc, PermanentError) else logging.WARNING
            log.log(level, "%s: reconcile failed (%d in a row), retrying in %.1f s: %s",
                    key, failures, delay, exc, exc_info=not isinstance(exc, OperatorError))
            self.add_after(key, delay)
        else:
            self._failures.pop(key, None)
            if isinstance(keep, RecheckAfter):
                self._replace_timer(key, min(max(keep.seconds, 0.0), self.tuning.resync_s))
            elif keep:
                self._replace_timer(key, self.tuning.resync_s)
            else:
                self.forget(key)

    def _replace_timer(self, key: K, delay_s: float) -> None:
        pending = self._timers.pop(key, None)
        if pending is not None:
            pending[1].cancel()
        self.add_after(key, delay_s)
