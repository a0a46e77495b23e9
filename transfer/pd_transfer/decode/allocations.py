"""The decode side of the grant protocol: AllocRequests, pre-grants, Withdraw / Withdrawn.

``_Allocations`` answers a writer's AllocRequest with a Grant (the ring has room), a
Watermark (the part queues, FIFO, or is queued or scattering already) or a GrantRefused (it
can never fit: only its request fails, OversizedChunk); a re-sent AllocRequest gets the same
Grant again. It pre-grants a staged writer's part 0 with its RequestKV, serves the queue as
space frees, and asks unwritten pre-grants back (``Withdraw``, again every ``grant_s``) when
the queued part at the head does not fit or a resize drains the ring. The bookkeeping is
``RingGrants``'; this class sends, counts and fails (decode/__init__.py has the rules).
"""

from __future__ import annotations

from pd_transfer.common.phases import Stamp
from pd_transfer.decode.context import ReceiverContext
from pd_transfer.decode.transfer import ReceiveTransfer, _InPart, _Writer
from pd_transfer.errors import OversizedAllocation
from pd_transfer.kv.ring import Region
from pd_transfer.kv.staging import staged_chunk_bytes
from pd_transfer.protocol import messages as wire
from pd_transfer.protocol.lifecycle import FailureReason
from pd_transfer.protocol.parts import PartEvent, PartState

__all__: list[str] = []  # package-internal: DecodeReceiver composes it


class _Allocations:
    """The grant protocol of one ``DecodeReceiver`` (module docstring); runs on its worker."""

    def __init__(self, ctx: ReceiverContext) -> None:
        self._ctx = ctx

    # Pre-grants with the RequestKV ---------------------------------------------------------

    def pregrant(self, transfer: ReceiveTransfer, writer: _Writer) -> Region | None:
        """The region granted to ``writer``'s part 0 with its RequestKV: granted now if the
        ring allows, the same one for a re-sent RequestKV, else None. Its scatter of the
        whole share is prepared with it."""
        ctx = self._ctx
        if writer.path != "staged" or ctx.resizing():
            return None
        part = writer.parts.get(0)
        if part is not None:  # asked before, or part 0 was named since
            return part.region if part.pregranted and part.state is PartState.GRANTED else None
        part = ctx.grants.pregrant(transfer, writer, self.writer_share(transfer, writer))
        if part is None:
            return None
        region = part.region
        assert region is not None
        part.stamps[Stamp.PREGRANTED] = part.granted_at
        part.prepared = ctx.scatters.prepare(transfer, writer, region,
                                             *transfer.share_ranges(writer),
                                             ring_buffer=ctx.ring_buffer())
        ctx.metrics.pregrant("granted")
        return region

    def writer_share(self, transfer: ReceiveTransfer, writer: _Writer) -> int:
        """Staged bytes of ``writer``'s whole share of the request: no part is larger."""
        return staged_chunk_bytes(self._ctx.pool.layout, writer.plan.layers.count,
                                  len(transfer.dst_pages), writer.plan.heads.num_heads)

    def _give_back(self, writer: _Writer, part: _InPart) -> None:
        """``part``'s writer gave its pre-grant back unwritten: free the region, forget it."""
        self._ctx.grants.give_back(writer, part)
        self._ctx.metrics.pregrant("returned")

    # Messages --------------------------------------------------------------------------------

    def on_alloc(
        self, transfer: ReceiveTransfer, writer: _Writer, msg: wire.AllocRequest
    ) -> None:
        ctx = self._ctx
        if writer.path != "staged":
            ctx.reject("wrong_path", f"AllocRequest on the {writer.path} path")
            return
        part = writer.part(msg.part)
        part.stamps.setdefault(Stamp.ALLOC_RECEIVED, ctx.clock())
        if part.state is PartState.ARRIVED:
            ctx.reject("duplicate", f"AllocRequest for delivered part {msg.part}")
            return
        if part.state is PartState.GRANTED and part.pregranted:
            self._give_back(writer, part)  # the writer could not use it (decode/__init__.py)
            part = writer.part(msg.part)
            part.stamps[Stamp.ALLOC_RECEIVED] = ctx.clock()
        if part.state is PartState.GRANTED:  # a re-sent request: the same grant again
            if ctx.ring_version() > 1:  # the writer may have missed the RingUpdate it needs
                ctx.send(writer.peer, ctx.ring_update())
            ctx.send(writer.peer, self._grant(transfer, writer, part))
            return
        if part.state in (PartState.QUEUED, PartState.SCATTERING):
            ctx.send(writer.peer, self._watermark(transfer, writer, msg.part))
            return
        if writer.final is not None and msg.part >= writer.final:
            ctx.violation(transfer, writer.peer, f"part {msg.part} beyond final {writer.final}")
            return
        most = self.writer_share(transfer, writer)
        if msg.size_bytes > most:
            ctx.violation(transfer, writer.peer, f"AllocRequest of {msg.size_bytes} bytes; "
                          f"the whole request is at most {most}")
            return
        part.size_bytes = msg.size_bytes
        if ctx.resizing():  # no new grants while a resize drains the ring
            self._enqueue(transfer, writer, part)
            return
        try:
            region = ctx.grants.allocate(transfer.room, msg.size_bytes)
        except OversizedAllocation as exc:
            self._refuse(transfer, writer, part, exc)
            return
        if region is None:
            self._enqueue(transfer, writer, part)
            return
        self._give(transfer, writer, part, region)

    def on_withdrawn(self, writer: _Writer) -> None:
        part = writer.parts.get(0)
        if part is None or not (part.pregranted and part.state is PartState.GRANTED):
            # Its AllocRequest gave it back first, or it was written: nothing is held.
            self._ctx.reject("duplicate", f"Withdrawn from {writer.peer}: no pre-grant is held")
            return
        self._give_back(writer, part)

    def _give(self, transfer: ReceiveTransfer, writer: _Writer, part: _InPart,
              region: Region) -> None:
        """Grant ``region`` to ``part`` and tell its writer."""
        ctx = self._ctx
        ctx.grants.give(writer, part, region)
        ctx.send(writer.peer, self._grant(transfer, writer, part))
        part.stamps[Stamp.GRANT_SENT] = ctx.clock()

    def _enqueue(self, transfer: ReceiveTransfer, writer: _Writer, part: _InPart) -> None:
        """No ring space for ``part`` now: queue it (FIFO), tell its writer it waits."""
        ctx = self._ctx
        ctx.grants.enqueue(transfer, writer, part)
        ctx.metrics.set_pending_allocations(ctx.grants.queued)
        ctx.send(writer.peer, self._watermark(transfer, writer, part.index))

    def _refuse(self, transfer: ReceiveTransfer, writer: _Writer, part: _InPart,
                exc: OversizedAllocation) -> None:
        """``part`` can never fit the ring: GrantRefused, and only its request fails."""
        ctx = self._ctx
        writer.move(part, PartEvent.REFUSE, ctx.part_machine)
        ctx.send(writer.peer, wire.GrantRefused(
            room=transfer.room, ticket=transfer.ticket, part=part.index,
            sender_id=writer.plan.sender_id,
            needed_bytes=part.size_bytes, capacity_bytes=ctx.ring().capacity_bytes))
        ctx.fail(transfer, FailureReason.OVERSIZED_CHUNK, str(exc), skip_peer=writer.peer)

    def _grant(self, transfer: ReceiveTransfer, writer: _Writer, part: _InPart) -> wire.Grant:
        assert part.region is not None
        return wire.Grant(room=transfer.room, ticket=transfer.ticket, part=part.index,
                          sender_id=writer.plan.sender_id,
                          ring_offset=part.region.offset_bytes, size_bytes=part.region.size_bytes,
                          ring_version=self._ctx.ring_version())

    def _watermark(
        self, transfer: ReceiveTransfer, writer: _Writer, part: int
    ) -> wire.Watermark:
        ring = self._ctx.ring()
        return wire.Watermark(
            used_bytes=ring.used_bytes, capacity_bytes=ring.capacity_bytes,
            largest_free_bytes=ring.largest_free_extent_bytes,
            pending_allocations=self._ctx.grants.queued, room=transfer.room,
            ticket=transfer.ticket, part=part,
            sender_id=writer.plan.sender_id)

    # Progress: the queue, asking pre-grants back -------------------------------------------

    def serve_queue(self) -> bool:
        """Grant queued allocations in arrival order while the ring has room (FIFO: a big
        part at the head is not starved by smaller ones behind it). Nothing while a resize
        is under way."""
        ctx = self._ctx
        served = False
        while ctx.grants.queued and not ctx.resizing():
            taken = ctx.grants.grant_head()
            if taken is None:
                self._reclaim_pregrants()
                break
            queued, region = taken
            with ctx.guard(queued.transfer):
                if isinstance(region, OversizedAllocation):  # queued before a shrink
                    self._refuse(queued.transfer, queued.writer, queued.part, region)
                else:
                    self._give(queued.transfer, queued.writer, queued.part, region)
            served = True
        ctx.metrics.set_pending_allocations(ctx.grants.queued)
        return served

    def _reclaim_pregrants(self) -> None:
        """A queued part does not fit: ask for unwritten pre-grants back (``Withdraw``, the
        latest granted first, again every ``grant_s``) until they and the largest free
        extent could hold it (``RingGrants.to_reclaim``)."""
        now = self._ctx.clock()
        for transfer, writer, part in self._ctx.grants.to_reclaim():
            if self._withdraw(transfer, writer, part, now):
                self._ctx.metrics.pregrant("reclaimed")

    def withdraw_pregrants(self) -> None:
        """A resize drains the ring: ask each writer holding an unwritten pre-grant to give
        it back (``Withdraw``, again every ``grant_s`` until it lands or returns)."""
        now = self._ctx.clock()
        for transfer, writer, part in self._ctx.grants.live_pregrants():
            self._withdraw(transfer, writer, part, now)

    def _withdraw(self, transfer: ReceiveTransfer, writer: _Writer, part: _InPart,
                  now: float) -> bool:
        """Ask ``writer`` for its pre-grant back, unless asked within ``grant_s``; True if
        asked now for the first time."""
        first = part.withdraw_sent_at is None
        if not self._ctx.grants.withdraw_due(part, now):
            return False
        self._ctx.send(writer.peer, wire.Withdraw(room=transfer.room, ticket=transfer.ticket,
                                                  sender_id=writer.plan.sender_id))
        return first
