"""Parts arriving on decode: notifications checked, staged parts scattered, requests completed.

Only a WRITE's notification counts a part as arrived (docs/failure-modes.md #9): a
StagedPart (staged path) must match its grant, the ring version in force and the plan, and
its scatter then runs from the region (the region is freed when it has); a PartDone (direct
paths) must match the plan. Each part's cells are claimed once in its writer's coverage and
its index checked against the writer's final count (docs/failure-modes.md #28). A request
completes when every writer reported its final count, that many parts are Arrived and none
is Queued, Granted or Scattering (docs/failure-modes.md #8): decode then sends Release.
"""

from __future__ import annotations

from pd_transfer.common.phases import Stamp
from pd_transfer.decode.context import ReceiverContext
from pd_transfer.decode.transfer import ReceiveTransfer, _InPart, _Writer
from pd_transfer.kv.staging import staged_chunk_bytes
from pd_transfer.protocol import messages as wire
from pd_transfer.protocol.coverage import CoverageError
from pd_transfer.protocol.lifecycle import Event, State
from pd_transfer.protocol.parts import PartEvent, PartState

__all__: list[str] = []  # package-internal: DecodeReceiver composes it


class _Arrivals:
    """The arriving parts of one ``DecodeReceiver`` (module docstring); runs on its worker."""

    def __init__(self, ctx: ReceiverContext) -> None:
        self._ctx = ctx

    def on_staged(
        self, transfer: ReceiveTransfer, writer: _Writer, msg: wire.StagedPart
    ) -> None:
        ctx = self._ctx
        part = writer.part(msg.part)
        notified = ctx.clock()
        if part.state in (PartState.SCATTERING, PartState.ARRIVED):
            ctx.reject("duplicate", f"notification for part {msg.part} again")
            return
        if msg.ring_version != ctx.ring_version():  # every live grant is of the current ring
            ctx.reject("stale_registration", f"part {msg.part}: ring version "
                       f"{msg.ring_version}, the ring in force is {ctx.ring_version()}")
            ctx.violation(transfer, writer.peer, f"StagedPart for ring version "
                          f"{msg.ring_version} (in force: {ctx.ring_version()})")
            return
        region = part.region
        if part.state is not PartState.GRANTED or region is None:
            ctx.violation(transfer, writer.peer,
                          f"notification for part {msg.part}, never granted")
            return
        plan = writer.plan
        layers = range(msg.layer_start, msg.layer_stop)
        pages = range(msg.page_start, msg.page_start + msg.page_count)
        if not self._claim(transfer, writer, msg, layers, pages):
            return
        expected = staged_chunk_bytes(ctx.pool.layout, len(layers), len(pages),
                                      plan.heads.num_heads)
        # A pre-granted region holds the writer's whole share; any other its part's size.
        fits = (msg.size_bytes <= region.size_bytes if part.pregranted
                else msg.size_bytes == region.size_bytes)
        if msg.ring_offset != region.offset_bytes or not fits or expected != msg.size_bytes:
            ctx.reject("region_mismatch", f"part {msg.part}: [{msg.ring_offset}, "
                       f"+{msg.size_bytes}) layers {layers} pages {pages}; granted "
                       f"[{region.offset_bytes}, +{region.size_bytes}), {expected} expected")
            ctx.violation(transfer, writer.peer, "notification does not match its grant")
            return
        ctx.part_machine.apply(part, PartEvent.LAND)
        part.stamps[Stamp.NOTIFIED] = notified
        if msg.size_bytes < region.size_bytes:  # the unwritten tail of a pre-grant: free now
            region = part.region = ctx.ring().shrink(region, msg.size_bytes)
            assert region is not None  # a Granted part's region is live
        if part.pregranted:
            ctx.metrics.pregrant("used")
        move, part.prepared = part.prepared, None
        if move is not None and (layers, pages) == transfer.share_ranges(writer):
            ctx.metrics.scatter_launched("grant")
        else:
            move = ctx.scatters.prepare(transfer, writer, region, layers, pages,
                                        ring_buffer=ctx.ring_buffer())
            ctx.metrics.scatter_launched("notification")
        ran = ctx.scatters.launch(part, move)
        part.stamps[Stamp.SCATTER_QUEUED] = ctx.clock()
        if ran:  # CPU: the copy ran in the launch
            self._landed(transfer, writer, part)

    def on_part_done(
        self, transfer: ReceiveTransfer, writer: _Writer, msg: wire.PartDone
    ) -> None:
        ctx = self._ctx
        if writer.path == "staged":
            ctx.violation(transfer, writer.peer, "PartDone on the staged path")
            return
        part = writer.part(msg.part)
        if part.state is PartState.ARRIVED:
            ctx.reject("duplicate", f"notification for part {msg.part} again")
            return
        layers = range(msg.layer_start, msg.layer_stop)
        pages = range(msg.page_start, msg.page_start + msg.page_count)
        if self._claim(transfer, writer, msg, layers, pages):
            writer.move(part, PartEvent.NOTIFY, ctx.part_machine)
            part.stamps[Stamp.NOTIFIED] = ctx.clock()
            size = (writer.plan.num_parts * writer.plan.bytes_per_token_per_layer
                    * len(layers) * len(pages) * ctx.pool.layout.page_size)
            ctx.part_finished(transfer, writer.peer, writer.plan.sender_id, part.index,
                              writer.path, size, part.stamps)

    def progress(self) -> bool:
        """Land every part whose scatter finished (CUDA); complete its request if it was the
        last. True if one landed."""
        ctx = self._ctx
        busy = False
        for transfer in list(ctx.transfers.values()):
            with ctx.guard(transfer):
                for writer in list(transfer.writers.values()):
                    for part in writer.in_state(PartState.SCATTERING):
                        if ctx.scatters.finished(part):
                            self._landed(transfer, writer, part)
                            busy = True
                if busy:
                    self.check_complete(transfer)
        return busy

    def _landed(self, transfer: ReceiveTransfer, writer: _Writer, part: _InPart) -> None:
        ctx = self._ctx
        region, part.region = part.region, None
        assert region is not None
        ctx.ring().free(region)
        ctx.part_machine.apply(part, PartEvent.SCATTERED)
        part.stamps[Stamp.SCATTERED] = ctx.clock()
        ctx.part_finished(transfer, writer.peer, writer.plan.sender_id, part.index,
                          "staged", region.size_bytes, part.stamps)
        transfer.bytes += region.size_bytes
        ctx.metrics.bytes_moved("staged", region.size_bytes)

    def _claim(self, transfer: ReceiveTransfer, writer: _Writer,
               msg: wire.StagedPart | wire.PartDone, layers: range, pages: range) -> bool:
        """Check a landing part against the plan (docs/failure-modes.md #28): its final count
        agrees, its index is below it, its cells are inside the writer's promise and none
        landed before; then they count as covered. False: a counted violation failed the
        request (nothing claimed)."""
        ctx = self._ctx
        if msg.final_parts is not None:
            self.set_final(transfer, writer, msg.final_parts)
            if transfer.lifecycle.finished:
                return False
        if writer.final is not None and msg.part >= writer.final:
            ctx.violation(transfer, writer.peer, f"part {msg.part} landed but the writer's "
                          f"final part count is {writer.final} (parts 0..{writer.final - 1})")
            return False
        try:
            writer.coverage.claim(layers, pages)
        except CoverageError as exc:
            ctx.violation(transfer, writer.peer, f"part {msg.part}: {exc}")
            return False
        return True

    def set_final(self, transfer: ReceiveTransfer, writer: _Writer, final: int) -> None:
        beyond = sorted(p for p in writer.parts if p >= final)  # queued, granted or landed
        if (writer.final not in (None, final)) or beyond:
            self._ctx.violation(transfer, writer.peer, f"final part count {final} conflicts "
                                f"with {writer.final} / parts already named {beyond[-3:]}")
            return
        writer.final = final

    def check_complete(self, transfer: ReceiveTransfer) -> None:
        ctx = self._ctx
        if transfer.lifecycle.state is not State.TRANSFERRING:
            return
        for writer in transfer.writers.values():
            if writer.final is None or writer.arrived() != list(range(writer.final)) or (
                    writer.in_state(PartState.QUEUED, PartState.GRANTED, PartState.SCATTERING)):
                return
        for writer in transfer.writers.values():
            if not writer.coverage.complete:  # every part landed, yet cells are missing
                ctx.violation(transfer, writer.peer, f"all {writer.final} parts landed but "
                              f"{writer.coverage.missing()} were never written")
                return
        slots = len(transfer.dst_pages) * ctx.pool.layout.page_size
        for writer in transfer.writers.values():
            if writer.path != "staged":  # direct WRITEs: whole pages of the plan's layers
                transfer.bytes += writer.plan.bytes_per_token * slots
                ctx.metrics.bytes_moved(writer.path, writer.plan.bytes_per_token * slots)
        ctx.apply(transfer, Event.COMPLETE)
        for writer in transfer.writers.values():
            ctx.send(writer.peer, wire.Release(room=transfer.room, ticket=transfer.ticket))
