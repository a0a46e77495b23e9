"""Decode's RequestKV: held until the room is registered, checked, opened as a stream.

A RequestKV for a room not registered yet is buffered for ``kv_lease_s`` (docs/failure-modes.md
#2): a router sends both halves at once, and a loaded engine may queue the prefill half for
seconds before its first chunk registers the room; the lease is how long either side of a
request may wait for the other. Past it, decode gets an Abort (LeaseExpired).

Every RequestKV's ticket (its request incarnation) is checked against what this rank has
acted on from that decode agent (``protocol.tickets``): a re-sent RequestKV of a live
request is idempotent, one seen before for a request no longer live is a replay
(``replayed``), one below the window ``stale_ticket``, and another ticket for a room whose
stream is open ``ticket_conflict``; none of them is acted on (docs/failure-modes.md #49).
Each refused RequestKV is answered with an Abort of its ticket (``ProtocolViolation``,
naming the refusal), so decode fails that request at once rather than at its deadline
(#58).

A request serves one decode instance (docs/failure-modes.md #60): the one the engine named
when it registered the room (the instance at the bootstrap address the router gave), else the
first to ask. A RequestKV from a rank of any other instance (``unbound_peer``), or a second
one for coordinates that have a stream already (``duplicate_coords``), is refused like the
others, and fails nothing: the request goes on with its own decode. Where the engine names
the instance after registering (``bind``), RequestKVs wait for it as early ones do.

Opening a stream checks the RequestKV against the request (pages, tokens, path)
and its pre-grant, if any: exactly the writer's whole share, inside the peer's ring, or the
request fails ProtocolViolation. A staged stream with a pre-grant is armed for gathers on
the engine's thread (gathers.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from pd_transfer.common.paths import compute_layout
from pd_transfer.kv.plan import TransferPlan
from pd_transfer.kv.staging import staged_chunk_bytes
from pd_transfer.prefill.context import SenderContext
from pd_transfer.prefill.gathers import EngineGathers
from pd_transfer.prefill.transfer import SendTransfer, _Stream
from pd_transfer.protocol import messages as wire
from pd_transfer.protocol.lifecycle import Event, FailureReason, State
from pd_transfer.protocol.tickets import TicketState, TicketWindow
from pd_transfer.trust.bootstrap import RankDocument

__all__ = ["MAX_EARLY_REQUESTS", "StreamOpener"]

MAX_EARLY_REQUESTS = 4096


class StreamOpener:
    """RequestKVs, early or not, into ``_Stream``s (module docstring); worker thread."""

    def __init__(self, ctx: SenderContext, transfers: Mapping[str, SendTransfer],
                 gathers: EngineGathers) -> None:
        """``transfers``: the endpoint's live requests by room (read only)."""
        self._ctx = ctx
        self._transfers = transfers
        self._engine_gathers = gathers
        # RequestKVs for rooms not registered yet: (peer, message, expiry) by room.
        self._early: dict[str, list[tuple[str, wire.RequestKV, float]]] = {}
        self._tickets: dict[str, TicketWindow] = {}  # by decode agent

    def early_count(self) -> int:
        """RequestKVs held for unregistered rooms (``debug_counts``)."""
        return sum(len(v) for v in self._early.values())

    def take_early(self, room: str) -> None:
        """``room`` was just registered (or bound): open the streams its early RequestKVs
        asked for, unless it still waits for the engine to name its decode instance."""
        transfer = self._transfers.get(room)
        if transfer is not None and transfer.awaiting_binding:
            return
        for peer, message, _ in self._early.pop(room, []):
            self._open(peer, message)  # checked, and its ticket marked, when it came

    def bind(self, room: str, instance: str) -> None:
        """The engine names ``room``'s decode instance; the RequestKVs that waited go on."""
        transfer = self._transfers.get(room)
        if transfer is None:
            return  # finished meanwhile
        if transfer.instance not in (None, instance):
            raise ValueError(f"room {room!r} serves decode instance {transfer.instance!r}, "
                             f"not {instance!r}")
        transfer.instance = instance
        transfer.awaiting_binding = False
        self.take_early(room)

    def on_request_kv(self, peer: str, message: wire.RequestKV) -> None:
        ctx = self._ctx
        document = ctx.peers.get(peer)
        if document is None or document.role != "decode":
            ctx.reject("unknown_peer", f"RequestKV from {peer}, not a known decode rank")
            return
        if (document.pp_rank, document.tp_rank) != (message.decode_pp_rank,
                                                    message.decode_tp_rank):
            self._refuse(peer, message, "coord_mismatch",
                         f"{peer} is rank {document.coord}, claims otherwise")
            return
        window = self._tickets.setdefault(peer, TicketWindow())
        now = ctx.clock()
        state = window.state(message.ticket, now)
        if state is TicketState.LEAP:
            self._refuse(peer, message, "ticket_leap", f"RequestKV for {message.room!r} "
                         f"ticket {message.ticket} from {peer}, far ahead of its highest "
                         f"({window.highest})")
            return
        if state is TicketState.STALE:
            self._refuse(peer, message, "stale_ticket", f"RequestKV for {message.room!r} "
                         f"ticket {message.ticket} from {peer}, below the window "
                         f"({window.highest})")
            return
        if state is TicketState.SEEN:
            if not self._holds(peer, message):
                self._refuse(peer, message, "replayed", f"RequestKV for {message.room!r} "
                             f"ticket {message.ticket} from {peer}: acted on before, no "
                             f"longer live")
            return  # else a re-sent RequestKV of a live request: idempotent
        transfer = self._transfers.get(message.room)
        if transfer is None or transfer.awaiting_binding:
            waiting = self._early.setdefault(message.room, [])
            if self.early_count() >= MAX_EARLY_REQUESTS:
                self._refuse(peer, message, "early_buffer_full",
                             f"RequestKV for {message.room!r} from {peer}")
            elif all(p != peer for p, _, _ in waiting):
                waiting.append((peer, message, ctx.clock() + self._early_wait_s()))
                window.mark(message.ticket, now)
            else:
                self._refuse(peer, message, "ticket_conflict", f"RequestKV for "
                             f"{message.room!r} ticket {message.ticket} from {peer}, which "
                             f"asked with another already")
            if not waiting:
                del self._early[message.room]
            return
        if peer in transfer.streams:
            self._refuse(peer, message, "ticket_conflict", f"RequestKV for {message.room!r} "
                         f"ticket {message.ticket} from {peer}; its stream is ticket "
                         f"{transfer.streams[peer].ticket}")
            return
        window.mark(message.ticket, now)
        self._open(peer, message)

    def _open(self, peer: str, message: wire.RequestKV) -> None:
        ctx = self._ctx
        document = ctx.peers.get(peer)
        transfer = self._transfers.get(message.room)
        if document is None or transfer is None:  # pruned meanwhile (failed its requests)
            ctx.reject("unknown_peer", f"RequestKV from {peer}, no longer a known peer")
            return
        if peer in transfer.streams:
            return
        if transfer.instance not in (None, document.instance):
            self._refuse(peer, message, "unbound_peer",
                         f"RequestKV for {message.room!r} from {peer} of decode instance "
                         f"{document.instance!r}; the request serves {transfer.instance!r}")
            return
        if any(stream.document.coord == document.coord for stream in transfer.streams.values()):
            self._refuse(peer, message, "duplicate_coords",
                         f"RequestKV for {message.room!r} from {peer} as rank "
                         f"{document.coord}, which another agent of the instance asked as")
            return
        with ctx.guard(transfer):
            self._open_stream(transfer, peer, document, message)

    def _refuse(self, peer: str, message: wire.RequestKV, reason: str, detail: str) -> None:
        """Count a refused RequestKV and answer it with an Abort of its ticket, so that the
        decode rank fails that request now instead of at its deadline (a decode that did not
        send it has no live request of that ticket, and ignores the Abort)."""
        self._ctx.reject(reason, detail)
        self._ctx.send(peer, wire.Abort(
            room=message.room, ticket=message.ticket,
            reason=FailureReason.PROTOCOL_VIOLATION.value,
            detail=f"prefill refused this RequestKV ({reason}): {detail}"[:1024]))

    def _holds(self, peer: str, message: wire.RequestKV) -> bool:
        """``peer``'s RequestKV with ``message``'s ticket is live here (held early, or its
        stream open)."""
        transfer = self._transfers.get(message.room)
        stream = transfer.streams.get(peer) if transfer is not None else None
        if stream is not None:
            return stream.ticket == message.ticket
        return any(p == peer and m.ticket == message.ticket
                   for p, m, _ in self._early.get(message.room, ()))

    def _early_wait_s(self) -> float:
        """How long a RequestKV for a room not registered yet is kept. Decode waits for
        the transfer up to its own deadline from that RequestKV, and prefill's engine may
        queue the request that long under load: refusing it sooner fails a request decode
        would still take. The KV lease bounds it from below, as before."""
        timeouts = self._ctx.timeouts
        return max(timeouts.kv_lease_s, timeouts.transfer_s)

    def expire_early(self, now: float) -> None:
        """Abort (LeaseExpired) the early RequestKVs whose room was not registered in time."""
        ctx = self._ctx
        for room, waiting in list(self._early.items()):
            for entry in [e for e in waiting if e[2] <= now]:
                waiting.remove(entry)
                ctx.reject("expired_early_request", f"RequestKV for unregistered {room!r}")
                ctx.send(entry[0], wire.Abort(room=room, ticket=entry[1].ticket,
                                              reason=FailureReason.LEASE_EXPIRED.value,
                                              detail="prefill never registered this room"))
            if not waiting:
                del self._early[room]

    def _open_stream(
        self, transfer: SendTransfer, peer: str, document: RankDocument, message: wire.RequestKV
    ) -> None:
        ctx = self._ctx
        coord = ctx.identity.coord
        plan = ctx.topology(document.parallelism).plan_between(coord, document.coord)
        if plan is None:
            ctx.reject("not_a_writer", f"{peer} asked rank {coord}, which sends it nothing")
            return
        layout = compute_layout(document)
        try:
            dst_pages = wire.expand_runs(message.dst_page_runs, document.num_pages)
        except Exception as exc:
            ctx.violation(transfer, peer, f"destination pages: {exc}")
            return
        problem = None
        first = message.first_page
        if (first + len(dst_pages) != transfer.total_pages
                or message.num_tokens != transfer.num_tokens
                or first * ctx.pool.layout.page_size >= transfer.num_tokens):
            problem = (f"decode wants {message.num_tokens} tokens in {len(dst_pages)} pages "
                       f"from page {first}, prefill holds {transfer.num_tokens} in "
                       f"{transfer.total_pages}")
        elif max(dst_pages) >= document.num_pages or len(set(dst_pages)) != len(dst_pages):
            problem = f"destination pages outside [0, {document.num_pages}) or repeated"
        elif message.path == "contiguous" and plan.heads.num_heads != layout.kv_heads:
            problem = "contiguous path asked for a partial head slice"
        elif message.path == "sliced" and not layout.is_token_major:
            problem = (f"sliced path asked for {layout.page_format.value} pages packed "
                       f"{layout.packing.value} (it needs token-major pages)")
        elif message.path == "staged" and document.ring is None:
            problem = "staged path but the decode rank published no staging ring"
        if problem is not None:
            ctx.violation(transfer, peer, problem)
            return
        transfer.instance = document.instance
        if transfer.expected is None:
            plans = ctx.topology(document.parallelism).plans_from(coord)
            transfer.expected = frozenset((p.decode.pp_rank, p.decode.tp_rank) for p in plans)
        pregrant = None
        if message.pregrant_offset is not None and message.pregrant_bytes is not None:
            pregrant = self._check_pregrant(transfer, peer, document, plan, len(dst_pages),
                                            message)
            if pregrant is None:
                return
        transfer.streams[peer] = _Stream(peer, document, layout, plan, message.path, dst_pages,
                                         message.ticket, first_page=first, pregrant=pregrant)
        if message.path == "staged":
            transfer.page_ids(ctx.pool)  # now, not on the way of the first part
            self._engine_gathers.arm(transfer, transfer.streams[peer])
        if transfer.lifecycle.state is State.BOOTSTRAPPING:
            transfer.transfer_deadline = ctx.clock() + ctx.timeouts.transfer_s
            ctx.apply(transfer, Event.START)

    def _check_pregrant(  # noqa: PLR0917 - private; _open_stream's checked values
        self, transfer: SendTransfer, peer: str, document: RankDocument, plan: TransferPlan,
        num_pages: int, message: wire.RequestKV,
    ) -> wire.Grant | None:
        """The RequestKV's pre-grant as part 0's Grant, if it is exactly the writer's whole
        share inside the peer's ring of its version; a violation fails the request (None).
        One of a ring version not in force here is no pre-grant: part 0 asks."""
        assert message.pregrant_offset is not None and message.pregrant_bytes is not None
        ctx = self._ctx
        share = staged_chunk_bytes(ctx.pool.layout, plan.layers.count, num_pages,
                                   plan.heads.num_heads)
        ring = document.ring
        span = f"[{message.pregrant_offset}, +{message.pregrant_bytes})"
        if message.pregrant_bytes != share:
            ctx.violation(transfer, peer, f"pre-grant {span} for a share of {share} bytes")
            return None
        if ring is not None and message.ring_version == document.ring_version and (
                message.pregrant_offset + message.pregrant_bytes > ring.size_bytes):
            ctx.reject("region_mismatch", f"pre-grant {span} in a {ring.size_bytes}-byte ring")
            ctx.violation(transfer, peer, "pre-grant outside the ring")
            return None
        return wire.Grant(room=transfer.room, ticket=message.ticket, part=0,
                          sender_id=plan.sender_id,
                          ring_offset=message.pregrant_offset,
                          size_bytes=message.pregrant_bytes, ring_version=message.ring_version)
