"""The decode-side staging ring: which byte ranges of the staging buffer are granted to whom.

Pure bookkeeping over offsets ``[0, capacity_bytes)``; the buffer itself, and the transport
registration of it, live elsewhere. Decode grants a region per incoming chunk, a prefill
rank WRITEs into it, decode scatters from it and frees it.

Policy (next-fit, a ring when frees come in order): an allocation takes the first free
extent at or after the cursor (the end of the most recently allocated region) that fits,
and otherwise wraps and takes the first one from offset 0. With first-in-first-out frees
this is exactly a ring buffer; out-of-order frees only leave holes that later allocations
reuse. An empty ring resets its cursor to 0, so an allocation of the whole capacity always
succeeds on an empty ring (a wrapped ring that never reset was a public bug: an empty ring
refused a chunk it could hold).

Release paths: ``free`` (idempotent per region: a second free is a no-op returning False),
``free_owner`` (abort / failure / timeout of a request: everything it holds), and
``quarantine`` for a region a late remote write may still land in: it stays occupied, is
never handed out again, and ``free_owner`` leaves it alone until ``release_quarantined``.

``allocate`` returning None means "no room right now": the caller queues and retries after a
free. A size above the capacity can never fit and raises OversizedAllocation instead, so one
oversized chunk fails its own request and nothing else. The ring is guarded by one lock, so
the transfer worker and a metrics reader may share it.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

from pd_transfer.errors import OversizedAllocation, RingError

__all__ = ["Region", "StagingRing"]


@dataclass(frozen=True)
class Region:
    """A granted byte range: ``[offset_bytes, offset_bytes + reserved_bytes)``.

    ``size_bytes`` is what was asked; ``reserved_bytes`` is that rounded up to the ring's
    alignment. ``region_id`` is never reused, so a stale Region can never free a newer one.
    """

    region_id: int
    owner: str
    offset_bytes: int
    size_bytes: int
    reserved_bytes: int

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.reserved_bytes


class StagingRing:
    """Allocator of aligned byte regions inside a staging buffer of ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, alignment_bytes: int = 256) -> None:
        if alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
            raise ValueError(f"alignment_bytes must be a power of two, got {alignment_bytes}")
        if capacity_bytes <= 0 or capacity_bytes % alignment_bytes:
            raise ValueError(
                f"capacity_bytes must be a positive multiple of the alignment "
                f"({alignment_bytes}), got {capacity_bytes}"
            )
        self.capacity_bytes = capacity_bytes
        self.alignment_bytes = alignment_bytes
        self._lock = threading.Lock()
        self._next_id = 0
        self._cursor = 0
        self._live: dict[int, Region] = {}
        self._quarantined: dict[int, Region] = {}
        # Occupied (live and quarantined) ranges as (offset, region_id), sorted by offset.
        self._occupied: list[tuple[int, int]] = []
        self._used_bytes = 0
        self._high_water_bytes = 0

    # Allocation and release ---------------------------------------------------------------

    def allocate(self, owner: str, size_bytes: int) -> Region | None:
        """Grant ``size_bytes`` to ``owner``, or None when no free extent fits right now.

        Raises OversizedAllocation (state unchanged) when ``size_bytes > capacity_bytes``.
        """
        if size_bytes <= 0:
            raise ValueError(f"allocate: size_bytes must be positive, got {size_bytes}")
        if size_bytes > self.capacity_bytes:
            raise OversizedAllocation(size_bytes, self.capacity_bytes, owner)
        reserved = -(-size_bytes // self.alignment_bytes) * self.alignment_bytes
        with self._lock:
            if not self._occupied:
                self._cursor = 0
            offset = self._find_offset(reserved)
            if offset is None:
                return None
            region = Region(self._next_id, owner, offset, size_bytes, reserved)
            self._next_id += 1
            self._live[region.region_id] = region
            bisect.insort(self._occupied, (offset, region.region_id))
            self._cursor = region.end_bytes
            self._used_bytes += reserved
            self._high_water_bytes = max(self._high_water_bytes, self._used_bytes)
            return region

    def free(self, region: Region) -> bool:
        """Release a live region. False (and no change) if it is not live: already freed,
        released with its owner, quarantined, or not from this ring."""
        with self._lock:
            if self._live.get(region.region_id) != region:
                return False
            del self._live[region.region_id]
            self._release(region)
            return True

    def shrink(self, region: Region, size_bytes: int) -> Region | None:
        """Keep only the first ``size_bytes`` of a live region; the rest is free at once.
        Returns the region now in force (the same id and offset: free that one, not
        ``region``), or None (no change) if ``region`` is not live. A pre-granted region
        holds a writer's whole share; its first part may fill only its start."""
        if not 0 < size_bytes <= region.size_bytes:
            raise ValueError(f"shrink: size_bytes must be in (0, {region.size_bytes}], "
                             f"got {size_bytes}")
        reserved = -(-size_bytes // self.alignment_bytes) * self.alignment_bytes
        with self._lock:
            if self._live.get(region.region_id) != region:
                return None
            kept = Region(region.region_id, region.owner, region.offset_bytes, size_bytes,
                          reserved)
            self._live[region.region_id] = kept
            self._used_bytes -= region.reserved_bytes - reserved
            if self._cursor == region.end_bytes:
                self._cursor = kept.end_bytes
            return kept

    def free_owner(self, owner: str) -> int:
        """Release every live region of ``owner``; returns how many. Quarantined ones stay."""
        with self._lock:
            mine = [r for r in self._live.values() if r.owner == owner]
            for region in mine:
                del self._live[region.region_id]
                self._release(region)
            return len(mine)

    def quarantine(self, region: Region) -> bool:
        """Keep a live region occupied but out of every owner's hands until released.

        For a region a late remote write may still land in (a timed-out writer). False if
        the region is not live.
        """
        with self._lock:
            if self._live.get(region.region_id) != region:
                return False
            del self._live[region.region_id]
            self._quarantined[region.region_id] = region
            return True

    def release_quarantined(self, region: Region | None = None) -> int:
        """Release one quarantined region, or all of them when ``region`` is None."""
        with self._lock:
            if region is None:
                victims = list(self._quarantined.values())
            elif self._quarantined.get(region.region_id) == region:
                victims = [region]
            else:
                victims = []
            for victim in victims:
                del self._quarantined[victim.region_id]
                self._release(victim)
            return len(victims)

    # Statistics ---------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Reserved bytes of live and quarantined regions."""
        with self._lock:
            return self._used_bytes

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self.capacity_bytes - self._used_bytes

    @property
    def quarantined_bytes(self) -> int:
        with self._lock:
            return sum(r.reserved_bytes for r in self._quarantined.values())

    @property
    def largest_free_extent_bytes(self) -> int:
        """The largest allocation that would succeed right now."""
        with self._lock:
            return max((end - start for start, end in self._gaps()), default=0)

    @property
    def live_regions(self) -> int:
        """Granted regions not yet released (quarantined ones are counted apart)."""
        with self._lock:
            return len(self._live)

    @property
    def quarantined_regions(self) -> int:
        with self._lock:
            return len(self._quarantined)

    @property
    def high_water_bytes(self) -> int:
        """Most bytes ever in use at once since creation or ``reset_high_water``."""
        with self._lock:
            return self._high_water_bytes

    def reset_high_water(self) -> None:
        """Restart the watermark from the current usage (e.g. per reporting period)."""
        with self._lock:
            self._high_water_bytes = self._used_bytes

    def owners(self) -> frozenset[str]:
        """Owners holding at least one live region."""
        with self._lock:
            return frozenset(r.owner for r in self._live.values())

    def regions_of(self, owner: str) -> tuple[Region, ...]:
        """``owner``'s live regions, by offset."""
        with self._lock:
            return tuple(sorted(
                (r for r in self._live.values() if r.owner == owner),
                key=lambda r: r.offset_bytes,
            ))

    # Internals (called with the lock held) ------------------------------------------------

    def _region(self, region_id: int) -> Region:
        region = self._live.get(region_id) or self._quarantined.get(region_id)
        if region is None:
            raise RingError(f"staging ring corrupted: occupied region {region_id} is unknown")
        return region

    def _gaps(self) -> list[tuple[int, int]]:
        """Free extents ``(start, end)`` in offset order."""
        gaps: list[tuple[int, int]] = []
        position = 0
        for offset, region_id in self._occupied:
            if offset > position:
                gaps.append((position, offset))
            position = self._region(region_id).end_bytes
        if position < self.capacity_bytes:
            gaps.append((position, self.capacity_bytes))
        return gaps

    def _find_offset(self, reserved: int) -> int | None:
        gaps = self._gaps()
        # First pass: from the cursor to the end of the buffer; second: wrap to offset 0.
        for start, end in gaps:
            begin = max(start, self._cursor)
            if end - begin >= reserved:
                return begin
        for start, end in gaps:
            if end - start >= reserved:
                return start
        return None

    def _release(self, region: Region) -> None:
        self._occupied.remove((region.offset_bytes, region.region_id))
        self._used_bytes -= region.reserved_bytes
        if not self._occupied:
            self._cursor = 0
