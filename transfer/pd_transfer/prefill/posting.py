"""Posting a part's WRITE and polling it to DONE.

Contiguous and sliced parts are written straight into decode's pages, their ``PartDone``
attached (``post_direct``). A staged part is written from its staging region into the ring
region decode granted, its ``StagedPart`` attached, once its gather has finished and the
grant is of the peer's ring version in force (``try_post_staged``): a grant of a newer
version waits for its RingUpdate, so nothing is ever written with an older registration.
Part 0 of an armed share (gathers.py) posts the WRITE prepared when its space was set aside
(``prepare_share``) if it still goes to the same region with the same grant; otherwise that
one is discarded. Every posted WRITE keeps its sealed notification for ``Endings``'
re-notification; a WRITE that fails tells a live peer with an Abort.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pd_transfer.common.paths import compute_contiguous_spans, compute_sliced_spans
from pd_transfer.common.phases import Stamp
from pd_transfer.errors import DescriptorError, PeerUnreachable, TransportError
from pd_transfer.kv.plan import LayerRange
from pd_transfer.kv.ring import Region
from pd_transfer.prefill.context import SenderContext
from pd_transfer.prefill.transfer import SendTransfer, _OutPart, _Stream
from pd_transfer.protocol import messages as wire
from pd_transfer.protocol.lifecycle import FailureReason
from pd_transfer.protocol.parts import PartEvent
from pd_transfer.transport.base import (
    PreparedWrite,
    RegisteredRegion,
    Span,
    TransferHandle,
    TransferState,
)

__all__ = ["Poster"]

_log = logging.getLogger("pd_transfer")


@dataclass(frozen=True, eq=False)
class _PreparedShare:
    """The WRITE of an armed share (``EngineGathers.arm``): from ``region`` into the
    ``grant`` (the pre-grant), with the StagedPart of the whole share as its notification."""

    region: Region
    grant: wire.Grant
    write: PreparedWrite
    note: bytes  # its sealed StagedPart


class Poster:
    """Posts parts' WRITEs and polls them (module docstring); holds the armed shares'
    prepared WRITEs (worker thread only), by (room, decode rank)."""

    def __init__(self, ctx: SenderContext) -> None:
        self._ctx = ctx
        self._writes: dict[tuple[str, str], _PreparedShare] = {}

    def prepared_count(self) -> int:
        """Prepared WRITEs held (``debug_counts``)."""
        return len(self._writes)

    def prepare_share(  # noqa: PLR0917 - private to the package; the armed share's fields
        self, transfer: SendTransfer, stream: _Stream, pages: range, pregrant: wire.Grant,
        region: Region, size: int,
    ) -> None:
        """Prepare the WRITE of ``stream``'s whole share (``pages``, ``size`` bytes gathered
        into ``region``) into its pre-grant, for part 0 to post."""
        ctx = self._ctx
        note, local, remote, regions = self._staged_write(transfer, stream, 0,
                                                          stream.plan.layers, pages, 1,
                                                          pregrant, region.offset_bytes, size)
        try:
            self._writes[transfer.room, stream.peer] = _PreparedShare(
                region, pregrant, ctx.transport.prepare_write(stream.peer, local, remote,
                                                              regions, note), note)
        except TransportError as exc:  # the part's own post meets it again and handles it
            _log.debug("room %s: no WRITE prepared for %s: %s", transfer.room, stream.peer, exc)

    def discard_share(self, room: str, peer: str) -> None:
        """Free the WRITE prepared for ``room``'s share to ``peer``, if one is held."""
        held = self._writes.pop((room, peer), None)
        if held is not None:
            self._ctx.transport.discard(held.write)

    def post_direct(self, transfer: SendTransfer, stream: _Stream, out: _OutPart) -> None:
        """Contiguous or sliced: one WRITE straight into decode's pages, PartDone attached."""
        ctx = self._ctx
        layers, pages = self._pairs(transfer, stream, out)
        src_bases = ctx.pool.base_table()
        dst_bases = stream.document.layer_bases
        if stream.path == "contiguous":
            local, remote = compute_contiguous_spans(
                ctx.pool.layout, src_bases=src_bases, dst=stream.layout, dst_bases=dst_bases,
                layers=layers, pages=pages)
        else:
            local, remote = compute_sliced_spans(
                ctx.pool.layout, src_bases=src_bases, dst=stream.layout, dst_bases=dst_bases,
                layers=layers, pages=pages, plan=stream.plan)
        note = wire.PartDone(room=transfer.room, ticket=stream.ticket, part=out.index,
                             sender_id=stream.plan.sender_id, layer_start=out.layers.start,
                             layer_stop=out.layers.stop,
                             page_start=out.pages.start - stream.first_page,
                             page_count=len(out.pages), final_parts=out.final)
        regions = [r.to_region() for r in stream.document.kv_regions]
        out.size_bytes = sum(length for _, length in local)
        sealed = ctx.seal(stream.peer, note)
        self._post(transfer, stream, out,
                   lambda: ctx.transport.write(stream.peer, local, remote, regions, sealed),
                   len(local), sealed)

    def try_post_staged(self, transfer: SendTransfer, stream: _Stream, out: _OutPart) -> bool:
        """Post a staged part's WRITE if it is granted in the ring in force and gathered."""
        ctx = self._ctx
        grant, staging = out.grant, out.region
        if grant is None or staging is None or not self.gathered(out):
            return False
        document = ctx.peer_document(stream)
        ring = document.ring
        assert ring is not None  # checked when the stream opened
        if grant.ring_version != document.ring_version:
            return False  # granted in a ring whose RingUpdate has not arrived yet
        if grant.ring_offset + grant.size_bytes > ring.size_bytes:
            ctx.reject("region_mismatch", f"grant [{grant.ring_offset}, +{grant.size_bytes})"
                       f" in a {ring.size_bytes}-byte ring")
            ctx.violation(transfer, stream.peer, "grant outside the ring")
            return True
        held = self._writes.pop((transfer.room, stream.peer), None) if out.index == 0 else None
        if held is not None and held.region is staging and held.grant == grant:
            write = held.write  # the same bytes into the same region, the same StagedPart
            ctx.counts.prepared_writes_posted += 1
            self._post(transfer, stream, out, lambda: ctx.transport.post(write), 1, held.note)
            return True
        if held is not None:
            ctx.transport.discard(held.write)
        note, local, remote, regions = self._staged_write(
            transfer, stream, out.index, out.layers, out.pages, out.final, grant,
            staging.offset_bytes, out.size_bytes)
        self._post(transfer, stream, out,
                   lambda: ctx.transport.write(stream.peer, local, remote, regions, note),
                   len(local), note)
        return True

    def _staged_write(  # noqa: PLR0917 - private; a part's fields, as both callers hold them
        self, transfer: SendTransfer, stream: _Stream, index: int, layers: LayerRange,
        pages: range, final: int | None, grant: wire.Grant, staging_offset: int, size: int,
    ) -> tuple[bytes, list[Span], list[Span], list[RegisteredRegion]]:
        """A staged part's WRITE: its sealed StagedPart and its one descriptor pair (from
        ``size`` staging bytes at ``staging_offset`` into the granted ring region)."""
        ctx = self._ctx
        ring = ctx.peer_document(stream).ring
        assert ring is not None  # checked when the stream opened
        note = wire.StagedPart(
            room=transfer.room, ticket=stream.ticket, part=index, sender_id=stream.plan.sender_id,
            ring_offset=grant.ring_offset, size_bytes=grant.size_bytes,
            layer_start=layers.start, layer_stop=layers.stop,
            page_start=pages.start - stream.first_page, page_count=len(pages),
            ring_version=grant.ring_version, final_parts=final,
        )
        granted = RegisteredRegion(f"{ring.name}@{grant.ring_offset}",
                                   ring.base_address + grant.ring_offset, grant.size_bytes,
                                   ring.to_region().kind, ring.device_id)
        local = [(ctx.buffer.region.base_address + staging_offset, size)]
        remote = [(granted.base_address, grant.size_bytes)]
        return ctx.seal(stream.peer, note), local, remote, [granted]

    def _post(  # noqa: PLR0917 - private; the part, its transport call and what it carries
        self, transfer: SendTransfer, stream: _Stream, out: _OutPart,
        post: Callable[[], TransferHandle], descriptors: int, note: bytes,
    ) -> None:
        """Post ``out``'s WRITE (``post``: the transport call, its notification the sealed
        ``note``, kept for ``Endings``' re-notification) and account for it."""
        ctx = self._ctx
        out.note = note
        try:
            out.handle = post()
        except PeerUnreachable as exc:
            ctx.prune_peer(stream.peer, str(exc))
            return
        except DescriptorError as exc:
            ctx.violation(transfer, stream.peer, f"descriptors refused: {exc}")
            return
        except TransportError as exc:
            ctx.fail(transfer, FailureReason.TRANSPORT_FAILED, str(exc))
            return
        ctx.part_machine.apply(out, PartEvent.POST)
        out.stamps[Stamp.POSTED] = ctx.clock()
        ctx.metrics.write_posted(stream.path, descriptors)

    def poll_write(self, transfer: SendTransfer, stream: _Stream, out: _OutPart) -> bool:
        """Take a posted WRITE's DONE (free its staging, keep its notification) or failure."""
        ctx = self._ctx
        assert out.handle is not None
        state = ctx.transport.state(out.handle)
        if state is TransferState.PENDING:
            return False
        ctx.transport.release(out.handle)
        out.handle = None
        if state is TransferState.FAILED:
            # Tell a live peer from a dead one: messaging a dead peer raises at once and
            # prunes it (→ PeerUnreachable for all its requests).
            if ctx.send(stream.peer, wire.Abort(room=transfer.room, ticket=stream.ticket,
                                                 reason="TransportFailed")):
                ctx.fail(transfer, FailureReason.TRANSPORT_FAILED,
                         f"a WRITE to {stream.peer} failed", notify=False)
            return True
        if out.region is not None:
            ctx.buffer.ring.free(out.region)
        transfer.bytes += out.size_bytes
        if out.note is not None:
            stream.written[out.index], stream.written_at = out.note, ctx.clock()
        ctx.metrics.bytes_moved(stream.path, out.size_bytes)
        ctx.part_machine.apply(out, PartEvent.DONE)
        out.stamps[Stamp.WRITTEN] = ctx.clock()
        ctx.part_finished(transfer, stream.peer, stream.plan.sender_id, out.index,
                          stream.path, out.size_bytes, out.stamps)
        del stream.out[out.index]
        return True

    def gathered(self, out: _OutPart) -> bool:
        """Whether the part's gather has finished (CUDA: its event fired); stamps it once."""
        if Stamp.GATHERED in out.stamps:
            return True
        if out.gathered is not None and not out.gathered.query():  # type: ignore[no-untyped-call]
            return False
        out.stamps[Stamp.GATHERED] = self._ctx.clock()
        return True

    def _pairs(
        self, transfer: SendTransfer, stream: _Stream, out: _OutPart
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        plan = stream.plan
        layers = [(g - self._ctx.stage.start, g - plan.layers.start + plan.dst_layer_start)
                  for g in range(out.layers.start, out.layers.stop)]
        first = stream.first_page
        pages = [(transfer.src_pages[i], stream.dst_pages[i - first]) for i in out.pages]
        return layers, pages
