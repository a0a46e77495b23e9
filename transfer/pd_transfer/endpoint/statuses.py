"""``StatusBoard``: the request statuses engine threads read while the worker writes them.

The worker publishes every change of a request's ``RequestStatus``; any thread polls by room.
A finished status stays until the engine has read it (``forget``) or the board holds
``FINISHED_STATUSES`` newer ones (docs/failure-modes.md #11). Thread-safe; the only state an
endpoint shares with other threads besides its command queue.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Final

from pd_transfer.protocol.lifecycle import RequestStatus

__all__ = ["FINISHED_STATUSES", "StatusBoard"]

FINISHED_STATUSES: Final = 16384  # bound on terminal statuses kept for polling


class StatusBoard:
    def __init__(self, finished_limit: int = FINISHED_STATUSES) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, RequestStatus] = {}
        self._finished: OrderedDict[str, RequestStatus] = OrderedDict()
        self._limit = finished_limit

    def publish(self, status: RequestStatus) -> None:
        with self._lock:
            if status.finished:
                self._live.pop(status.room, None)
                self._finished[status.room] = status
                self._finished.move_to_end(status.room)
                while len(self._finished) > self._limit:
                    self._finished.popitem(last=False)
            else:
                self._live[status.room] = status

    def get(self, room: str) -> RequestStatus | None:
        """The latest status of ``room`` (live or recently finished), None if unknown."""
        with self._lock:
            status = self._live.get(room)
            return status if status is not None else self._finished.get(room)

    def forget(self, room: str) -> None:
        """Drop a finished request's status (the engine has read it)."""
        with self._lock:
            self._finished.pop(room, None)

    def live_count(self) -> int:
        with self._lock:
            return len(self._live)
