"""``RingGrants``: the decode side's staging-ring bookkeeping, pure (no transport, no sending).

It owns the ring in force (``ring``, ``version``), the FIFO of parts waiting for space, the
pre-grants' share limit, which unwritten pre-grants to ask back, and the quarantine. It
changes parts' states (through the endpoint's ``PartMachine``) and regions, and answers with
values: the receiver sends the messages, counts the metrics and fails requests.

- Grants: a part is granted a region at once when the ring has room (``allocate``,
  ``give``); otherwise it queues (``enqueue``), and ``grant_head`` allocates for the oldest
  queued part only, so a big part at the head is not starved by smaller ones behind it. A
  queued part larger than the ring (after a shrink) comes back with its
  ``OversizedAllocation``.
- Pre-grants (``pregrant``): a writer's part 0 gets its whole share ahead of its
  AllocRequest when nothing is queued and live pre-grants stay within ``pregrant_share`` of
  the ring. When the head of the queue does not fit, ``to_reclaim`` names the unwritten
  pre-grants to ask back, the latest granted first, until they and the largest free extent
  could hold it; ``withdraw_due`` spaces the asks ``resend_s`` apart; ``give_back`` frees
  one its writer returned.
- Quarantine (``release``): when a request ends, a Granted part's region that a live writer
  may still WRITE into stays occupied until its own late StagedPart (``late_write``), its
  writer's Withdrawn (``late_withdrawn``), the writer's death (``drop_writer``) or its
  expiry (``expire``); everything else is freed at once.
- Resize (``swap``): a new ring, ``version`` + 1. A region quarantined in a retired ring
  pins that ring's buffer (``pins``) until it is dropped: ``on_unpinned(version)`` then says
  the buffer may go.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass

from pd_transfer.decode.transfer import ReceiveTransfer, _InPart, _Writer
from pd_transfer.errors import OversizedAllocation
from pd_transfer.kv.ring import Region, StagingRing
from pd_transfer.protocol.parts import PartEvent, PartMachine, PartState, Quarantined

__all__ = ["RingGrants"]

#: A part and who it belongs to: its request and its writer.
_Held = tuple[ReceiveTransfer, _Writer, _InPart]


@dataclass(frozen=True)
class _Queued:
    """An AllocRequest waiting for ring space (served first in, first out)."""

    transfer: ReceiveTransfer
    writer: _Writer
    part: _InPart


class RingGrants:
    """Grants, queue, pre-grants and quarantine of one decode rank's ring (module docstring).

    ``transfers``: the endpoint's live requests by room (read, never changed: pre-grants are
    found in them); ``parts``: the endpoint's part-state machine; ``clock``: the endpoint's.
    """

    def __init__(self, ring_bytes: int, *, pregrant_share: float, resend_s: float,
                 transfers: Mapping[str, ReceiveTransfer], parts: PartMachine,
                 clock: Callable[[], float], on_unpinned: Callable[[int], None]) -> None:
        self.ring = StagingRing(ring_bytes)
        self.version = 1
        self.pregrant_share = pregrant_share
        self._resend_s = resend_s
        self._transfers = transfers
        self._parts = parts
        self._clock = clock
        self._on_unpinned = on_unpinned
        self._queue: collections.deque[_Queued] = collections.deque()
        self._quarantine: list[Quarantined] = []

    @property
    def queued(self) -> int:
        """Parts waiting for ring space."""
        return len(self._queue)

    @property
    def quarantined(self) -> tuple[Quarantined, ...]:
        """Quarantined regions, oldest first (of the ring in force or a retired one)."""
        return tuple(self._quarantine)

    # Grants and the queue -------------------------------------------------------------------

    def allocate(self, room: str, size_bytes: int) -> Region | None:
        """A region for ``room`` now, or None (no room now); raises OversizedAllocation
        (nothing changed) when ``size_bytes`` can never fit the ring."""
        return self.ring.allocate(room, size_bytes)

    def give(self, writer: _Writer, part: _InPart, region: Region) -> None:
        """``part`` is Granted ``region`` of the ring in force, now."""
        part.region, part.granted_at, part.ring_version = region, self._clock(), self.version
        writer.move(part, PartEvent.GRANT, self._parts)

    def enqueue(self, transfer: ReceiveTransfer, writer: _Writer, part: _InPart) -> None:
        """No ring space for ``part`` now: it is Queued, behind every part queued before."""
        writer.move(part, PartEvent.QUEUE, self._parts)
        self._queue.append(_Queued(transfer, writer, part))

    def grant_head(self) -> tuple[_Queued, Region | OversizedAllocation] | None:
        """The oldest queued part with a region allocated for it, or with the reason it can
        never fit (a shrink since it queued): taken off the queue either way, not yet
        Granted (``give``). None: it does not fit now (it stays at the head) or nothing is
        queued."""
        if not self._queue:
            return None
        queued = self._queue[0]
        try:
            region = self.ring.allocate(queued.transfer.room, queued.part.size_bytes)
        except OversizedAllocation as exc:
            self._queue.popleft()
            return queued, exc
        if region is None:
            return None
        self._queue.popleft()
        return queued, region

    # Pre-grants -----------------------------------------------------------------------------

    def pregrant(self, transfer: ReceiveTransfer, writer: _Writer,
                 size_bytes: int) -> _InPart | None:
        """``writer``'s part 0, Granted a region of ``size_bytes`` (its whole share) ahead of
        its AllocRequest: only while nothing is queued, live pre-grants and this one stay
        within ``pregrant_share`` of the ring, and the ring has room now. None otherwise
        (part 0 then asks; the request fails then only if that part cannot fit)."""
        if self._queue or self.pregranted_bytes() + size_bytes > (
                self.ring.capacity_bytes * self.pregrant_share):
            return None
        try:
            region = self.ring.allocate(transfer.room, size_bytes)
        except OversizedAllocation:
            return None
        if region is None:
            return None
        part = writer.part(0)
        part.size_bytes, part.pregranted = size_bytes, True
        part.region, part.granted_at, part.ring_version = region, self._clock(), self.version
        writer.move(part, PartEvent.GRANT, self._parts)
        return part

    def pregranted_bytes(self) -> int:
        """Ring bytes held by pre-grants, written or not (the scatter may still read them)."""
        return sum(part.region.size_bytes for _, _, part in self.pregrants()
                   if part.region is not None)

    def pregrants(self) -> list[_Held]:
        """Every pre-granted part still holding its region (only ever a writer's part 0), by
        request (in admission order) and writer."""
        return [(transfer, writer, part)
                for transfer in self._transfers.values()
                for writer in transfer.writers.values()
                if (part := writer.parts.get(0)) is not None and part.pregranted
                and part.region is not None]

    def live_pregrants(self) -> list[_Held]:
        """Every pre-grant a writer may still WRITE into."""
        return [held for held in self.pregrants() if held[2].state is PartState.GRANTED]

    def to_reclaim(self) -> list[_Held]:
        """The queued part at the head does not fit: the unwritten pre-grants to ask back,
        the latest granted first (ties: the later request), until they and the largest free
        extent could hold it. A writer whose WRITE is posted keeps its region; its
        StagedPart frees it when it lands."""
        if not self._queue:
            return []
        needed_bytes = self._queue[0].part.size_bytes
        reclaimable = self.ring.largest_free_extent_bytes
        latest_first = sorted(reversed(self.live_pregrants()),
                              key=lambda held: -held[2].granted_at)
        asked: list[_Held] = []
        for held in latest_first:
            if reclaimable >= needed_bytes:
                break
            region = held[2].region
            assert region is not None
            reclaimable += region.size_bytes
            asked.append(held)
        return asked

    def withdraw_due(self, part: _InPart, now: float) -> bool:
        """Ask for ``part``'s pre-grant back now? Not if asked within ``resend_s``;
        otherwise True, and the ask is recorded at ``now``."""
        sent = part.withdraw_sent_at
        if sent is not None and now - sent < self._resend_s:
            return False
        part.withdraw_sent_at = now
        return True

    def give_back(self, writer: _Writer, part: _InPart) -> None:
        """``part``'s writer gave its pre-grant back unwritten: free the region, forget it."""
        assert part.pregranted and part.region is not None
        self.ring.free(part.region)
        part.region = None
        self._parts.apply(part, PartEvent.WITHDRAW)
        del writer.parts[part.index]

    # Endings and the quarantine ------------------------------------------------------------

    def release(self, transfer: ReceiveTransfer, *, live_peers: Container[str],
                expiry: float) -> None:
        """``transfer`` ended: drop its queued parts, free the regions its Scattering parts
        read (the caller waited for their scatters), quarantine until ``expiry`` a Granted
        part's region whose writer is in ``live_peers``, free the rest, drop its parts."""
        if any(q.transfer is transfer for q in self._queue):
            self._queue = collections.deque(q for q in self._queue if q.transfer is not transfer)
        for writer in transfer.writers.values():
            for part in writer.in_state(PartState.SCATTERING):
                if part.region is not None:
                    self.ring.free(part.region)
            for part in writer.in_state(PartState.GRANTED):
                assert part.region is not None
                if writer.peer in live_peers and self.ring.quarantine(part.region):
                    self._quarantine.append(Quarantined(part.region, writer.peer, expiry,
                                                        part.ring_version, transfer.ticket,
                                                        part.pregranted))
            writer.parts.clear()
        self.ring.free_owner(transfer.room)

    def late_write(self, peer: str, room: str, ticket: int, ring_offset: int,  # noqa: PLR0917
                   size_bytes: int, ring_version: int) -> bool:
        """A StagedPart for a request no longer live: release the quarantined region it
        wrote, if any. Its own request only (room and ticket): a written part's notification
        sent again (the writer heard no Release) may name a region that another request
        holds since, and a frame of an earlier request with the same room id is no write."""
        for entry in self._quarantine:
            if entry.region.owner == room and entry.matches(peer, ticket, ring_offset,
                                                            size_bytes, ring_version):
                self._drop(entry)
                return True
        return False

    def late_withdrawn(self, peer: str, room: str, ticket: int) -> bool:
        """A Withdrawn for a request no longer live: release its unwritten pre-grant, if
        held."""
        for entry in self._quarantine:
            if entry.pregranted and (entry.writer, entry.region.owner, entry.ticket) == (
                    peer, room, ticket):
                self._drop(entry)
                return True
        return False

    def drop_writer(self, peer: str) -> None:
        """``peer`` is dead: it writes nothing more into the regions quarantined for it."""
        for entry in [e for e in self._quarantine if e.writer == peer]:
            self._drop(entry)

    def expire(self, now: float) -> None:
        """Release every quarantined region whose grace ran out by ``now``."""
        for entry in [e for e in self._quarantine if e.expiry <= now]:
            self._drop(entry)

    def _drop(self, entry: Quarantined) -> None:
        """Release a quarantined region: in the ring in force, or of a retired ring (whose
        buffer may go once none of its regions may still be written)."""
        self._quarantine.remove(entry)
        version = entry.ring_version
        if version == self.version:
            self.ring.release_quarantined(entry.region)
        elif not self.pins(version):
            self._on_unpinned(version)

    # Resize ----------------------------------------------------------------------------------

    def pins(self, version: int) -> bool:
        """A quarantined region of ring ``version`` may still be written."""
        return any(e.ring_version == version for e in self._quarantine)

    def swap(self, new_bytes: int) -> None:
        """A new, empty ring of ``new_bytes`` is in force (``version`` + 1); the old ring's
        quarantined regions stay listed until dropped."""
        self.ring = StagingRing(new_bytes)
        self.version += 1
