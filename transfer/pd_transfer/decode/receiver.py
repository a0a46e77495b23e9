"""``DecodeReceiver``: one decode rank's endpoint: its engine API, its ring, message dispatch.

It asks the prefill ranks for a request's KV (``RequestKV``, with a pre-grant where the ring
allows), hands each message to the collaborator that acts on it (``_Allocations``:
AllocRequest, Withdrawn; ``_Arrivals``: StagedPart, PartDone, final counts; each given the
endpoint's services as one ``ReceiverContext``, context.py), runs the deadlines and endings,
and swaps the ring in a resize. The rules are in decode/__init__.py.
"""

from __future__ import annotations

import base64
import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from pd_transfer.common.metrics import TransferMetrics
from pd_transfer.common.paths import PathMode, choose_path, compute_layout
from pd_transfer.common.phases import PhaseLog
from pd_transfer.decode.allocations import _Allocations
from pd_transfer.decode.arrivals import _Arrivals
from pd_transfer.decode.context import ReceiverContext
from pd_transfer.decode.grants import RingGrants
from pd_transfer.decode.scatter import _Scatters
from pd_transfer.decode.transfer import ReceiveTransfer, _Writer
from pd_transfer.endpoint import (
    Endpoint,
    PollIntervals,
    RankIdentity,
    StagingMemory,
    StagingSide,
    Timeouts,
)
from pd_transfer.kv.plan import compute_transfer_topology
from pd_transfer.kv.pool import KVPool
from pd_transfer.kv.ring import StagingRing
from pd_transfer.protocol import messages as wire
from pd_transfer.protocol.lifecycle import Event, FailureReason, Role, State
from pd_transfer.protocol.parts import PartState
from pd_transfer.transport.base import RegisteredRegion, Transport
from pd_transfer.trust.auth import PeerAuth
from pd_transfer.trust.bootstrap import RankDocument

__all__ = ["PREGRANT_SHARE", "DecodeReceiver"]

#: The share of the ring live pre-grants may hold on CUDA (decode/__init__.py): all of it,
#: since a queued part that does not fit takes unwritten pre-grants back. A smaller share
#: keeps the rest for AllocRequests without that round trip. On CPU pre-grants are off by
#: default: a CPU transfer's copies take milliseconds, beside which the grant round trip is
#: small.
PREGRANT_SHARE = 1.0


class DecodeReceiver(Endpoint[ReceiveTransfer]):
    """One decode rank's receiving endpoint, with its staging ring (decode/__init__.py)."""

    role = Role.DECODE

    def __init__(self, transport: Transport, pool: KVPool, identity: RankIdentity, *,
                 auth: PeerAuth, ring_bytes: int, mode: PathMode = "auto",
                 timeouts: Timeouts | None = None,
                 metrics: TransferMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 phases: PhaseLog | None = None, poll: PollIntervals | None = None,
                 pregrant_share: float | None = None) -> None:
        """``pregrant_share``: the share of the ring live pre-grants may hold (0: none; every
        part asks with an AllocRequest). Default: ``PREGRANT_SHARE`` on CUDA, 0 on CPU."""
        if pregrant_share is None:
            pregrant_share = PREGRANT_SHARE if pool.device.type == "cuda" else 0.0
        if not 0.0 <= pregrant_share <= 1.0:
            raise ValueError(f"pregrant_share must be in [0, 1], got {pregrant_share}")
        staging = StagingSide[ReceiveTransfer](
            "ring", allocator=lambda: self.ring, version=lambda: self.ring_version,
            holds=lambda transfer: transfer.holds_staging(), swap=self._swap_ring)
        super().__init__(transport, pool, identity, auth=auth, staging=staging,
                         timeouts=timeouts, metrics=metrics, clock=clock, phases=phases,
                         poll=poll)
        self.mode: PathMode = mode
        self._memory = StagingMemory(transport, pool.device, ring_bytes, label="ring",
                                     stream=self._stream)
        self.grants = RingGrants(ring_bytes, pregrant_share=pregrant_share,
                                 resend_s=self.timeouts.grant_s, transfers=self._transfers,
                                 parts=self.part_machine, clock=self.clock,
                                 on_unpinned=self._unpinned)
        self.metrics.attach_ring(self.ring)
        self.metrics.set_staging(ring_bytes, self.ring_version)
        # Request incarnations (messages.Ticket): never one twice for this agent.
        self._tickets = itertools.count(1)
        self._retired: dict[int, torch.Tensor] = {}  # old ring buffers quarantine still pins
        self._scatters = _Scatters(pool, self._stream)
        ctx = ReceiverContext(
            pool=pool, metrics=self.metrics, clock=self.clock, part_machine=self.part_machine,
            grants=self.grants, scatters=self._scatters, transfers=self._transfers,
            resizing=lambda: self.resizing, ring=lambda: self.ring,
            ring_version=lambda: self.ring_version, ring_buffer=lambda: self.ring_buffer,
            ring_update=self._ring_update, send=self.send, reject=self.reject,
            guard=lambda t: self.guard(self._failer(t)), fail=self._fail,
            violation=self._violation, apply=self._apply, part_finished=self._part_finished)
        self._ctx = ctx
        self._allocations = _Allocations(ctx)
        self._arrivals = _Arrivals(ctx)

    @property
    def ring(self) -> StagingRing:
        """The ring in force (its bookkeeping: ``grants``)."""
        return self.grants.ring

    @property
    def ring_version(self) -> int:
        """The registration version of the ring in force (1, then + 1 per resize; the
        grants' version follows the memory's)."""
        return self._memory.version

    @property
    def ring_buffer(self) -> torch.Tensor:
        """The ring's memory in force."""
        return self._memory.memory

    @property
    def ring_region(self) -> RegisteredRegion:
        """The ring's registration in force."""
        return self._memory.region

    @property
    def pregrant_share(self) -> float:
        return self.grants.pregrant_share

    # Engine API ----------------------------------------------------------------------------

    def expect(
        self,
        room: str,
        page_ids: Sequence[int],
        num_tokens: int,
        *,
        first_page: int = 0,
        prefill_instance: str | None = None,
        mode: PathMode | None = None,
    ) -> Future[None]:
        """Ask the prefill ranks of ``prefill_instance`` (the only one known, by default)
        for ``room``'s KV, into ``page_ids``: the request's pages from ``first_page`` on, in
        order (decode's own prefix cache holds the ones before: they are not sent)."""
        pages = [int(p) for p in page_ids]
        return self.submit(lambda: self._expect(room, pages, num_tokens, prefill_instance,
                                                mode or self.mode, first_page=first_page))

    def debug_counts(self) -> dict[str, int]:
        """Sizes of every per-request structure (docs/failure-modes.md #11 tests compare to
        baseline)."""
        return {
            "transfers": len(self._transfers),
            "queued_allocations": self.grants.queued,
            "quarantined": len(self.grants.quarantined),
            "retired_rings": len(self._retired),
            "ring_live_regions": self.ring.live_regions,
            "ring_quarantined_regions": self.ring.quarantined_regions,
            **self.status_counts(),
        }

    # Commands ------------------------------------------------------------------------------

    def _expect(
        self, room: str, pages: list[int], num_tokens: int, instance: str | None,
        mode: PathMode, *, first_page: int,
    ) -> None:
        page_size = self.pool.layout.page_size
        if first_page < 0 or first_page * page_size >= num_tokens:
            raise ValueError(
                f"room {room!r}: first_page {first_page} leaves none of the {num_tokens} "
                f"tokens to receive (the last page holds the last token, which decode never "
                f"has cached)")
        self._check_new(room, pages, num_tokens - first_page * page_size, "expected")
        transfer = ReceiveTransfer(room, next(self._tickets), self.clock(), self._release,
                                   bootstrap_s=self.timeouts.bootstrap_s, dst_pages=pages,
                                   num_tokens=num_tokens, instance=instance, mode=mode,
                                   first_page=first_page)
        self._admit(transfer)
        with self.guard(self._failer(transfer)):
            self._bootstrap(transfer)

    def _bootstrap(self, transfer: ReceiveTransfer) -> None:
        """Find every writer rank, send each a RequestKV; waits (no-op) while one is unknown."""
        docs = [d for d in self.peers.values() if d.role == "prefill"]
        instances = {d.instance for d in docs}
        instance = transfer.instance
        if instance is None:
            if len(instances) != 1:
                return
            instance = next(iter(instances))
        group = {d.coord: (name, d) for name, d in self.peers.items()
                 if d.role == "prefill" and d.instance == instance}
        if not group:
            return
        parallelism = next(iter(group.values()))[1].parallelism
        topology = compute_transfer_topology(
            self.identity.geometry.kv_geometry(), parallelism, self.identity.parallelism)
        plans = topology.plans_into(self.identity.coord)
        if any(plan.prefill not in group for plan in plans):
            return
        now = self.clock()
        for plan in plans:
            name, doc = group[plan.prefill]
            src_layout = compute_layout(doc)
            path = choose_path(transfer.mode, plan, src_layout, self.pool.layout)
            transfer.add_writer(name, plan, src_layout, path, now)
        transfer.instance = instance
        transfer.transfer_deadline = now + self.timeouts.transfer_s
        if any(writer.path == "staged" for writer in transfer.writers.values()):
            self._scatters.dst_ids(transfer)  # now, not when the first part lands
        self._apply(transfer, Event.START)
        for writer in transfer.writers.values():
            self._ask(transfer, writer)

    def _ask(self, transfer: ReceiveTransfer, writer: _Writer) -> None:
        writer.asked_at = self.clock()
        region = self._allocations.pregrant(transfer, writer)
        self.send(writer.peer, wire.RequestKV(
            room=transfer.room, ticket=transfer.ticket, decode_pp_rank=self.identity.coord.pp_rank,
            decode_tp_rank=self.identity.coord.tp_rank,
            dst_page_runs=wire.compute_runs(transfer.dst_pages), num_tokens=transfer.num_tokens,
            path=writer.path,  # type: ignore[arg-type]
            ring_version=self.ring_version, first_page=transfer.first_page,
            pregrant_offset=None if region is None else region.offset_bytes,
            pregrant_bytes=None if region is None else region.size_bytes,
        ))

    def _on_peer_added(self, document: RankDocument) -> None:
        if self.ring_version > 1 and document.role == "prefill":
            self.send(document.agent_name, self._ring_update())  # it may hold an older doc
        for transfer in list(self._transfers.values()):
            if transfer.lifecycle.state is State.BOOTSTRAPPING:
                with self.guard(self._failer(transfer)):
                    self._bootstrap(transfer)

    # Messages ------------------------------------------------------------------------------

    def _on_message(self, peer: str, message: wire.Message) -> None:
        assert isinstance(message, wire.TO_DECODE)  # Endpoint.step refused the others
        transfer = self._transfers.get(message.room)
        if transfer is None or message.ticket != transfer.ticket:
            self._on_unknown_room(peer, message)
            return
        sender_id = None if isinstance(message, wire.Abort) else message.sender_id
        writer = transfer.writers.get(sender_id) if sender_id is not None else None
        if sender_id is not None and (writer is None or writer.peer != peer):
            self.reject("sender_mismatch", f"{peer} is not writer {sender_id} of "
                        f"{transfer.room!r}")
            return
        with self.guard(self._failer(transfer)):
            if isinstance(message, wire.Abort):
                if any(w.peer == peer for w in transfer.writers.values()):
                    self._fail(transfer, FailureReason.ABORTED_BY_PEER,
                               f"prefill {peer}: {message.reason}: {message.detail}",
                               skip_peer=peer)
                else:
                    self.reject("sender_mismatch", f"Abort from {peer}, not a writer")
                return
            assert writer is not None
            writer.heard = True
            if isinstance(message, wire.AllocRequest):
                self._allocations.on_alloc(transfer, writer, message)
            elif isinstance(message, wire.StagedPart):
                self._arrivals.on_staged(transfer, writer, message)
            elif isinstance(message, wire.PartDone):
                self._arrivals.on_part_done(transfer, writer, message)
            elif isinstance(message, wire.Withdrawn):
                self._allocations.on_withdrawn(writer)
            else:
                self._arrivals.set_final(transfer, writer, message.final_parts)
            self._arrivals.check_complete(transfer)

    def _on_unknown_room(self, peer: str, message: wire.Message) -> None:
        """A message for a request not live here: no live room, or a live room of another
        incarnation (an earlier request's frame, late or replayed: ``stale_ticket``)."""
        assert isinstance(message, wire.TO_DECODE)
        live = self._transfers.get(message.room)
        if isinstance(message, wire.StagedPart):  # a late write into a quarantined region?
            self.grants.late_write(peer, message.room, message.ticket, message.ring_offset,
                                   message.size_bytes, message.ring_version)
        if isinstance(message, wire.Withdrawn) and self.grants.late_withdrawn(
                peer, message.room, message.ticket):  # a failed request's pre-grant, unwritten
            return
        if isinstance(message, wire.AllocRequest) and peer in self.peers:
            self.send(peer, wire.Abort(room=message.room, ticket=message.ticket,
                                       reason="AbortedByPeer", detail="decode does not expect "
                                       "this request (finished or failed)"))
        if live is not None:
            self.reject("stale_ticket", f"{message.type} for {message.room!r} ticket "
                        f"{message.ticket} from {peer}; the live request is ticket {live.ticket}")
            return
        self.reject("unknown_room", f"{message.type} for {message.room!r} from {peer}")

    # Progress, deadlines, endings ------------------------------------------------------------

    def _moving(self) -> bool:
        """A writer has started sending (a part was named) or holds a pre-grant it may WRITE
        into at any moment: more messages, WRITEs and scatters are due."""
        return bool(self.grants.queued) or any(any(w.parts for w in t.writers.values())
                                               for t in self._transfers.values())

    def _progress(self) -> bool:
        busy = self._arrivals.progress()
        if self.resizing:
            self._allocations.withdraw_pregrants()
        if self.resizing and not self._step_resize():
            return busy  # still draining: nothing is granted meanwhile
        return self._allocations.serve_queue() or busy

    def _check_deadlines(self, now: float) -> None:
        self.grants.expire(now)
        for transfer in list(self._transfers.values()):
            with self.guard(self._failer(transfer)):
                self._check_transfer_deadlines(transfer, now)

    def _check_transfer_deadlines(self, transfer: ReceiveTransfer, now: float) -> None:
        state = transfer.lifecycle.state
        if state is State.BOOTSTRAPPING:
            if now >= transfer.bootstrap_deadline:
                self._fail(transfer, FailureReason.BOOTSTRAP_TIMEOUT,
                           f"the prefill ranks of instance {transfer.instance or '(any)'} were "
                           f"not all known within {self.timeouts.bootstrap_s} s")
            return
        if state is not State.TRANSFERRING:
            return
        if now >= transfer.transfer_deadline:
            missing = {w.plan.sender_id: (w.final, len(w.arrived()))
                       for w in transfer.writers.values()}
            self._fail(transfer, FailureReason.TRANSFER_TIMEOUT,
                       f"not complete within {self.timeouts.transfer_s} s; writers "
                       f"(final, arrived): {missing}")
            return
        for writer in transfer.writers.values():
            stalled = [p.index for p in writer.in_state(PartState.GRANTED)
                       if not p.pregranted and now - p.granted_at >= self.timeouts.stall_s]
            if stalled:
                self._fail(transfer, FailureReason.STALLED_WRITER,
                           f"writer {writer.peer} left parts {stalled} granted but unwritten "
                           f"for {self.timeouts.stall_s} s")
                return
            if not writer.heard and now - writer.asked_at >= self.timeouts.grant_s:
                self._ask(transfer, writer)  # the RequestKV may have been lost: idempotent

    def _release(self, transfer: ReceiveTransfer) -> None:
        """Terminal: free or quarantine every region, drop queued allocations. Runs once."""
        self._transfers.pop(transfer.room, None)
        expiry = self.clock() + self.timeouts.quarantine_grace_s
        self._scatters.wait(transfer)  # the scatters still read the regions freed now
        self.grants.release(transfer, live_peers=self.peers, expiry=expiry)
        self._allocations.serve_queue()

    def _on_peer_lost(self, peer: str, detail: str) -> None:
        self.grants.drop_writer(peer)  # a dead writer writes nothing more
        for transfer in list(self._transfers.values()):
            if any(w.peer == peer for w in transfer.writers.values()):
                self._fail(transfer, FailureReason.PEER_UNREACHABLE, detail, skip_peer=peer)

    def _unpinned(self, version: int) -> None:
        """No quarantined region of retired ring ``version`` may still be written: its
        buffer goes."""
        self._retired.pop(version, None)

    # Resize ----------------------------------------------------------------------------------

    def _swap_ring(self, new_bytes: int) -> None:
        """The drained ring's memory replaced (``StagingMemory.swap``), its bookkeeping too,
        and every prefill peer told (RingUpdate)."""
        version = self.ring_version
        old_buffer = self._memory.swap(new_bytes)
        if self.grants.pins(version):
            self._retired[version] = old_buffer  # a late write may still land in it
        self.grants.swap(new_bytes)
        assert self.grants.version == self.ring_version
        self.metrics.attach_ring(self.ring)
        update = self._ring_update()
        for name, document in list(self.peers.items()):
            if document.role == "prefill":
                self.send(name, update)

    def _ring_update(self) -> wire.RingUpdate:
        region = self.ring_region
        return wire.RingUpdate(
            ring_version=self.ring_version, name=region.name, base_address=region.base_address,
            size_bytes=region.size_bytes, kind=region.kind.value, device_id=region.device_id,
            transport_metadata_b64=base64.b64encode(self.transport.local_metadata()).decode())

    def _ring_region(self) -> RegisteredRegion | None:
        return self.ring_region

    def _ring_version(self) -> int:
        return self.ring_version
