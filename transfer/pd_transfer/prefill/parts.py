"""Making a request's parts for each decode rank, staging them, and their grants.

Each part the engine gives becomes, per decode rank that needs some of its layers and
pages, one ``_OutPart`` (``make``; a rank that needs none of the last part gets a
``Finish``). A staged part takes staging space, asks decode for a ring region with an
AllocRequest and is gathered at the end of the step (``stage``, ``enqueue_gathers``).

Pre-grants (protocol v5): a staged RequestKV may carry ring bytes already granted to part 0
(checked when the stream opens, streams.py). Part 0 writes into them without an
AllocRequest when its ring version is in force; otherwise its AllocRequest gives them back.
A ``Withdraw`` (decode resizing, or taking the region for a queued part) is answered with
``Withdrawn`` unless the WRITE is posted (a part that took the pre-grant but has not posted
then asks with an AllocRequest; ``withdraw``), and a request that fails holding an unwritten
pre-grant sends ``Withdrawn`` so decode frees it without waiting out its quarantine
(``Endings.release``).
"""

from __future__ import annotations

from pd_transfer.common.phases import Stamp
from pd_transfer.errors import OversizedAllocation
from pd_transfer.kv.plan import LayerRange
from pd_transfer.kv.staging import gather, staged_chunk_bytes
from pd_transfer.prefill.context import SenderContext
from pd_transfer.prefill.gathers import EngineGathers
from pd_transfer.prefill.posting import Poster
from pd_transfer.prefill.transfer import SendTransfer, _Gathered, _OutPart, _Stream
from pd_transfer.protocol import messages as wire
from pd_transfer.protocol.lifecycle import FailureReason
from pd_transfer.protocol.parts import PartEvent, PartState

__all__ = ["PartMaker"]


class PartMaker:
    """Parts, their staging space and their grants (module docstring); worker thread."""

    def __init__(self, ctx: SenderContext, gathers: EngineGathers, poster: Poster) -> None:
        self._ctx = ctx
        self._engine_gathers = gathers  # a Withdraw takes back what is set aside for part 0
        self._poster = poster  # a grant posts its part
        # Parts whose AllocRequest this step sent, gathered at its end (enqueue_gathers).
        self._gathers: list[tuple[SendTransfer, _Stream, _OutPart, range]] = []

    def make(self, transfer: SendTransfer, stream: _Stream) -> bool:
        """Turn the parts the engine gave since the last call into ``stream``'s parts."""
        ctx = self._ctx
        made = False
        while stream.next_spec < len(transfer.specs):
            spec = transfer.specs[stream.next_spec]
            stream.next_spec += 1
            plan_layers = stream.plan.layers
            start, stop = max(spec.layers.start, plan_layers.start), min(
                spec.layers.stop, plan_layers.stop)
            pages = range(max(spec.pages.start, stream.first_page), spec.pages.stop)
            if start < stop and pages:
                index = stream.parts_made
                stream.parts_made += 1
                final = stream.parts_made if spec.last else None
                out = stream.out[index] = _OutPart(
                    index=index, spec=spec, pages=pages, layers=LayerRange(start, stop),
                    final=final, stamps={Stamp.GIVEN: spec.given_at, Stamp.PICKED: ctx.clock()})
                if index == 0 and (gathered := spec.early.get(stream.peer)) is not None:
                    self._take_gathered(transfer, stream, out, gathered)
                made = True
            if spec.last and not stream.final_sent:
                stream.final_sent = True
                if start >= stop or not pages:
                    if stream.parts_made == 0:
                        raise ValueError(f"no part of {transfer.room!r} had layers for decode "
                                         f"rank {stream.plan.decode}")
                    ctx.send(stream.peer, wire.Finish(room=transfer.room, ticket=stream.ticket,
                                                      sender_id=stream.plan.sender_id,
                                                      final_parts=stream.parts_made))
        return made

    def stage(self, transfer: SendTransfer, stream: _Stream, out: _OutPart) -> bool:
        """Give a ready staged part its staging space and ask for (or take) its grant."""
        ctx = self._ctx
        if ctx.resizing():
            return False  # no new gather while the staging buffer is being re-sized
        stage = ctx.stage.start
        layers = range(out.layers.start - stage, out.layers.stop - stage)  # local layers
        heads = stream.plan.heads
        size = staged_chunk_bytes(ctx.pool.layout, len(layers), len(out.pages),
                                  heads.num_heads)
        ring = ctx.buffer.ring
        try:
            region = ring.allocate(transfer.room, size)
        except OversizedAllocation:
            ctx.fail(transfer, FailureReason.OVERSIZED_CHUNK,
                     f"a part needs {size} staging bytes but the prefill buffer holds "
                     f"{ring.capacity_bytes}; raise prefillBufferMiB to at least "
                     f"{-(-size // (1 << 20))} MiB or send smaller chunks")
            return True
        if region is None:
            return False  # the buffer is full: a finishing WRITE frees it
        out.region, out.size_bytes = region, size
        # The AllocRequest (if no pre-grant serves) goes now, the gather at the end of this
        # step (``enqueue_gathers``): decode's turn-around overlaps the gathers' enqueue,
        # and the AllocRequests of every part made ready in this step (one per decode rank)
        # leave before any gather is enqueued. No grant can be handled before the gather is
        # queued (messages are read at the start of a step).
        if self._use_pregrant(stream, out) or self._ask_grant(transfer, stream, out):
            self._gathers.append((transfer, stream, out, layers))
        return True  # (not asked: the peer is gone, its requests failed and freed staging)

    def _take_gathered(self, transfer: SendTransfer, stream: _Stream, out: _OutPart,
                       gathered: _Gathered) -> None:
        """Part 0 gathered by the engine's thread: it waits for its grant only."""
        out.region, out.size_bytes, out.gathered = (gathered.region, gathered.size_bytes,
                                                    gathered.event)
        out.stamps[Stamp.READY] = out.stamps[Stamp.PICKED]
        out.stamps[Stamp.GATHER_QUEUED] = out.stamps[Stamp.GATHER_ENQUEUED] = (
            gathered.enqueued_at)
        self._ctx.part_machine.apply(out, PartEvent.READY)
        self._ctx.part_machine.apply(out, PartEvent.GATHER)
        if not self._use_pregrant(stream, out):
            self._ask_grant(transfer, stream, out)

    def _use_pregrant(self, stream: _Stream, out: _OutPart) -> bool:
        """Part 0 takes its stream's pre-grant (its first ``size_bytes``) if it fits and its
        ring is in force; otherwise it asks, and its AllocRequest gives the pre-grant back."""
        if out.index != 0 or stream.pregrant is None:
            return False
        pregrant, stream.pregrant = stream.pregrant, None
        if out.size_bytes > pregrant.size_bytes or (
                pregrant.ring_version != self._ctx.peer_document(stream).ring_version):
            return False  # its ring was re-registered since
        out.grant = (pregrant if pregrant.size_bytes == out.size_bytes  # the whole share
                     else pregrant.model_copy(update={"size_bytes": out.size_bytes}))
        out.pregranted = True
        self._ctx.counts.pregrants_taken += 1
        out.stamps[Stamp.PREGRANT_TAKEN] = out.stamps[Stamp.GRANTED] = self._ctx.clock()
        return True

    def _ask_grant(self, transfer: SendTransfer, stream: _Stream, out: _OutPart) -> bool:
        """Send ``out``'s AllocRequest; False if the peer is gone (its requests failed)."""
        ctx = self._ctx
        out.alloc_sent_at = ctx.clock()
        ctx.counts.alloc_requests_sent += 1
        if not ctx.send(stream.peer, stream.alloc_request(transfer.room, out)):
            return False
        out.stamps[Stamp.ALLOC_SENT] = ctx.clock()
        return True

    def enqueue_gathers(self) -> None:
        """Enqueue the gathers whose AllocRequests this step sent (see ``stage``)."""
        ctx = self._ctx
        gathers, self._gathers = self._gathers, []
        for transfer, stream, out, layers in gathers:
            if transfer.lifecycle.finished:
                continue  # failed meanwhile: its staging space is freed
            with ctx.guard(transfer):
                region = out.region
                assert region is not None
                out.stamps[Stamp.GATHER_QUEUED] = ctx.clock()
                view = ctx.buffer.view(region, out.size_bytes)
                pages = transfer.page_ids(ctx.pool).select(out.pages.start, out.pages.stop)
                heads = stream.plan.heads
                if ctx.stream is not None:
                    # Its ready event has fired (``_advance``; on CUDA every part has one):
                    # its KV is written, and its page ids were uploaded on this stream
                    # (``thread_started``). Ordering it after the default stream's tail
                    # would make it wait for work queued since (later layers; failure #35).
                    gather(ctx.pool, layers, pages, head_start=heads.src_head_offset,
                           num_heads=heads.num_heads, out=view, stream=ctx.stream.stream)
                    out.gathered = ctx.stream.record()
                else:
                    gather(ctx.pool, layers, pages, head_start=heads.src_head_offset,
                           num_heads=heads.num_heads, out=view)
                out.stamps[Stamp.GATHER_ENQUEUED] = ctx.clock()
                ctx.part_machine.apply(out, PartEvent.GATHER)
                ctx.metrics.gathers_launched("worker", 1)

    def withdraw(self, transfer: SendTransfer, stream: _Stream) -> None:
        """Decode wants the pre-grant back (a resize, or a queued part needs the space): give
        it unless its WRITE is posted."""
        ctx = self._ctx
        out = stream.out.get(0)
        if stream.pregrant is not None:
            stream.pregrant = None
            # Gathered early or not, part 0 asks.
            self._engine_gathers.disarm(transfer.room, stream.peer)
        elif out is not None and out.pregranted and out.state is PartState.AWAITING_GRANT:
            out.grant, out.pregranted = None, False
            out.stamps.pop(Stamp.GRANTED, None)
            out.alloc_sent_at = ctx.clock()
            ctx.counts.alloc_requests_sent += 1
        else:
            return  # posted (its StagedPart is on its way) or given back already
        ctx.send(stream.peer, wire.Withdrawn(room=transfer.room, ticket=stream.ticket,
                                             sender_id=stream.plan.sender_id))
        if out is not None and out.state is PartState.AWAITING_GRANT and out.grant is None:
            ctx.send(stream.peer, stream.alloc_request(transfer.room, out))

    def grant(self, transfer: SendTransfer, stream: _Stream,
              msg: wire.Grant | wire.GrantRefused) -> None:
        """Decode's answer to a part's AllocRequest: a Grant posts the part if it can."""
        ctx = self._ctx
        out = stream.out.get(msg.part)
        if msg.sender_id != stream.plan.sender_id or out is None:
            ctx.reject("unexpected_grant", f"{msg.type} for part {msg.part} of "
                       f"{transfer.room!r}, sender {msg.sender_id}: never requested")
            return
        if out.state is not PartState.AWAITING_GRANT:
            if out.grant != msg:
                ctx.reject("unexpected_grant",
                           f"{msg.type} for part {msg.part} in {out.state.value}")
            return  # a duplicate of the grant in use
        if isinstance(msg, wire.GrantRefused):
            needed_mib = -(-msg.needed_bytes // (1 << 20))
            ctx.fail(transfer, FailureReason.OVERSIZED_CHUNK,
                     f"a part needs {msg.needed_bytes} staging bytes but decode's pool holds "
                     f"{msg.capacity_bytes}; raise decodePoolMiB to at least {needed_mib} "
                     f"MiB or send smaller chunks")
            return
        known = ctx.peer_document(stream)
        if msg.ring_version < known.ring_version:  # a grant of a ring since re-registered
            ctx.reject("stale_registration", f"grant for ring version {msg.ring_version}; "
                       f"{stream.peer}'s ring in force is version {known.ring_version}")
            return
        if msg.size_bytes != out.size_bytes:
            ctx.reject("region_mismatch", f"grant of {msg.size_bytes} bytes for a "
                       f"{out.size_bytes}-byte part")
            ctx.violation(transfer, stream.peer, "grant of the wrong size")
            return
        out.grant = msg  # a newer version than known waits for its RingUpdate
        out.stamps[Stamp.GRANTED] = ctx.clock()
        self._poster.try_post_staged(transfer, stream, out)
