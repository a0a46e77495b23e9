"""One staging resize at a time, the same lifecycle on both sides (decode's ring, prefill's
buffer).

``begin`` validates and records a ``PendingResize`` (a size already in force finishes at once:
nothing to drain, re-register or announce); each ``step`` on the worker drains (the side
hands out no staging space while ``under_way``), fails the requests still holding space at
the deadline (ResizeDeadline), then swaps the memory (``StagingSide.swap``) and finishes the
Future with a ``ResizeResult``. A failed swap leaves the old memory in force and fails the
Future with ``ResizeError``; ``cancel`` fails it when the endpoint closes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from pd_transfer.common.metrics import TransferMetrics
from pd_transfer.endpoint.types import ResizeResult
from pd_transfer.errors import ResizeError
from pd_transfer.kv.ring import StagingRing

__all__ = ["PendingResize", "StagingResizes", "StagingSide"]

_log = logging.getLogger("pd_transfer")
TransferT = TypeVar("TransferT")


@dataclass(frozen=True)
class StagingSide(Generic[TransferT]):
    """What a resize needs of one side's staging memory, as the side defines it."""

    name: str  # "ring" (decode) or "buffer" (prefill)
    allocator: Callable[[], StagingRing]  # what hands out the space in force
    version: Callable[[], int]  # the registration version in force
    holds: Callable[[TransferT], bool]  # the request holds staging space
    swap: Callable[[int], None]  # new memory of that size, registered and announced


@dataclass
class PendingResize:
    """A resize under way (at most one at a time)."""

    new_bytes: int
    started: float
    deadline: float
    future: Future[ResizeResult]
    failed_requests: int = 0


class StagingResizes(Generic[TransferT]):
    """Runs on the endpoint's worker thread only."""

    def __init__(self, side: StagingSide[TransferT], *, metrics: TransferMetrics,
                 clock: Callable[[], float], transfers: Callable[[], Iterable[TransferT]],
                 fail: Callable[[TransferT, str], None]) -> None:
        """``transfers``: the endpoint's live requests; ``fail(transfer, detail)`` fails one
        ResizeDeadline."""
        self.side = side
        self._metrics = metrics
        self._clock = clock
        self._transfers = transfers
        self._fail = fail
        self._pending: PendingResize | None = None

    @property
    def under_way(self) -> bool:
        return self._pending is not None

    def begin(self, new_bytes: int, deadline_s: float, done: Future[ResizeResult]) -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            if self._pending is not None:
                raise ResizeError(f"a resize to {self._pending.new_bytes} bytes is under way")
            if deadline_s < 0:
                raise ResizeError(f"deadline_s must be >= 0, got {deadline_s}")
            StagingRing(new_bytes)  # validates the size (positive, aligned)
        except (ResizeError, ValueError) as exc:
            done.set_exception(exc if isinstance(exc, ResizeError) else ResizeError(str(exc)))
            return
        side = self.side
        if new_bytes == side.allocator().capacity_bytes:
            # Already in force (a spec change that moved only the other side's size): no
            # drain, no re-registration, nothing for the peers to learn.
            done.set_result(ResizeResult(side.name, new_bytes, side.version(), 0.0, 0))
            return
        now = self._clock()
        self._pending = PendingResize(new_bytes, now, now + deadline_s, done)
        self._metrics.resize_started()
        _log.info("resizing the staging %s: %d → %d bytes (deadline %.1f s)", side.name,
                  side.allocator().capacity_bytes, new_bytes, deadline_s)
        self.step()

    def step(self) -> bool:
        """Drain, then swap: True when the resize finished (either way) in this step."""
        resize, side = self._pending, self.side
        assert resize is not None
        if side.allocator().live_regions and self._clock() >= resize.deadline:
            resize.failed_requests += self._fail_holders(
                f"its staging space was still in use when the {side.name} resize to "
                f"{resize.new_bytes} bytes reached its deadline")
        if side.allocator().live_regions:
            return False
        self._pending = None
        try:
            side.swap(resize.new_bytes)
        except Exception as exc:
            _log.exception("staging %s resize failed; the old one stays in force", side.name)
            self._end(resize, ResizeError(
                f"resize to {resize.new_bytes} bytes failed: {type(exc).__name__}: {exc}"))
        else:
            self._end(resize, None)
        return True

    def cancel(self, detail: str) -> None:
        """Fail a resize under way (the endpoint is closing)."""
        if self._pending is not None:
            resize, self._pending = self._pending, None
            self._end(resize, ResizeError(f"resize to {resize.new_bytes} bytes: {detail}"))

    def _fail_holders(self, detail: str) -> int:
        failed = 0
        for transfer in list(self._transfers()):
            if self.side.holds(transfer):
                failed += 1
                self._fail(transfer, detail)
        return failed

    def _end(self, resize: PendingResize, error: Exception | None) -> None:
        side = self.side
        duration = self._clock() - resize.started
        capacity, version = side.allocator().capacity_bytes, side.version()
        self._metrics.resize_finished(side.name, ok=error is None, duration_s=duration,
                                      staging_bytes=capacity, registration_version=version)
        if error is not None:
            resize.future.set_exception(error)
            return
        _log.info("staging %s resized to %d bytes (version %d) in %.3f s; %d requests failed "
                  "ResizeDeadline", side.name, capacity, version, duration,
                  resize.failed_requests)
        resize.future.set_result(ResizeResult(side.name, capacity, version, duration,
                                              resize.failed_requests))
