"""Requests in flight per engine: what ``least-load`` minimises and the
``pd_router_in_flight_requests`` gauge shows.

A request counts on an engine from just before it is sent until its answer has been read
to the end (or the exchange failed). An engine that left the rotation keeps its count
until its last request ends, then disappears from the snapshot.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from pd_transfer.router.endpoints import Endpoint

__all__ = ["InFlight"]


class InFlight:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[Endpoint, int] = {}

    def begin(self, endpoint: Endpoint) -> None:
        with self._lock:
            self._counts[endpoint] = self._counts.get(endpoint, 0) + 1

    def end(self, endpoint: Endpoint) -> None:
        with self._lock:
            left = self._counts[endpoint] - 1
            if left:
                self._counts[endpoint] = left
            else:
                del self._counts[endpoint]

    @contextmanager
    def track(self, endpoint: Endpoint) -> Iterator[None]:
        self.begin(endpoint)
        try:
            yield
        finally:
            self.end(endpoint)

    def load(self, endpoint: Endpoint) -> int:
        with self._lock:
            return self._counts.get(endpoint, 0)

    def snapshot(self) -> dict[Endpoint, int]:
        """Engines with requests in flight → how many."""
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())
