"""When each part of a request reached each step, on each side: the endpoints' own stamps.

Both endpoints stamp every part as it moves (``Stamp``: a few ``clock()`` readings per part,
kept on the part itself). With a ``PhaseLog`` attached (``PrefillSender(..., phases=log)``,
``DecodeReceiver(..., phases=log)``), a request that ends hands its parts' stamps to the log
as one ``RequestTimes``; ``take(room)`` pops it. Without a log nothing is kept beyond the
request's own lifetime. ``pd-transfer bench transfer`` splits a request's latency into
phases from these records (``bench.phases``).

The clock is the endpoint's (``time.monotonic`` by default: CLOCK_MONOTONIC, one clock for
every process of a host), so prefill and decode stamps of one host share an axis.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PartTimes", "PhaseLog", "RequestTimes", "Stamp"]


class Stamp(enum.StrEnum):
    """A step of one part on one side (each stamped once, when first reached)."""

    # prefill
    GIVEN = "given"  # the engine's send_part call (its thread)
    PICKED = "picked"  # the worker turned it into a part for this decode rank
    READY = "ready"  # its ready_event was seen fired (or it had none)
    ALLOC_SENT = "alloc_sent"  # staging space taken, the AllocRequest sent
    PREGRANT_TAKEN = "pregrant_taken"  # staging space taken, the RequestKV's pre-grant used
    GATHER_QUEUED = "gather_queued"  # the gather about to be enqueued
    GATHER_ENQUEUED = "gather_enqueued"  # the gather enqueued (CUDA: its event recorded)
    GRANTED = "granted"  # a usable Grant handled
    GATHERED = "gathered"  # the gather's event seen complete
    POSTED = "posted"  # the WRITE posted (direct paths: descriptors computed first)
    WRITTEN = "written"  # the WRITE seen DONE
    # decode
    ALLOC_RECEIVED = "alloc_received"  # its AllocRequest handled
    GRANT_SENT = "grant_sent"  # a region granted and the Grant sent
    PREGRANTED = "pregranted"  # a region granted with the RequestKV (part 0)
    NOTIFIED = "notified"  # its StagedPart / PartDone notification handled
    SCATTER_QUEUED = "scatter_queued"  # the scatter enqueued
    SCATTERED = "scattered"  # the scatter seen complete, the region freed


@dataclass(frozen=True)
class PartTimes:
    """One part's stamps on one side. ``peer``: the other side's agent (prefill: the decode
    rank it wrote to; decode: its writer); ``sender_id``: the writer's id; ``part``: its
    index within that (writer, decode rank) pair."""

    peer: str
    sender_id: int
    part: int
    path: str
    size_bytes: int
    stamps: Mapping[str, float]


@dataclass(frozen=True)
class RequestTimes:
    """A finished request on one side: when it was created and ended, and its parts."""

    room: str
    side: str  # "prefill" or "decode"
    state: str  # the terminal state
    created: float
    finished: float
    parts: tuple[PartTimes, ...]


class PhaseLog:
    """Finished requests' times, bounded (the oldest dropped first); thread-safe."""

    def __init__(self, max_requests: int = 4096) -> None:
        if max_requests <= 0:
            raise ValueError(f"max_requests must be positive, got {max_requests}")
        self._max = max_requests
        self._lock = threading.Lock()
        self._requests: OrderedDict[str, RequestTimes] = OrderedDict()

    def add(self, times: RequestTimes) -> None:
        with self._lock:
            self._requests[times.room] = times
            self._requests.move_to_end(times.room)
            while len(self._requests) > self._max:
                self._requests.popitem(last=False)

    def take(self, room: str) -> RequestTimes | None:
        """Pop ``room``'s record (None if it has not finished, or was dropped)."""
        with self._lock:
            return self._requests.pop(room, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._requests)
