"""The decode side: ``DecodeReceiver`` asks prefill ranks for a request's KV and lands it.

Engine API (any thread; calls return Futures resolved on the worker thread):
``expect(room, page_ids, num_tokens, prefill_instance=None, mode=None)`` → ``poll(room)``
until ``finished``; ``abort(room)``. The pages may be read once the status is Succeeded.

One ``ReceiveTransfer`` per request owns all of its state: per expected writer (a prefill
rank, by sender id) its plan and path, its final part count once known, and its parts,
each in one ``PartState`` (Queued, Granted, Scattering, Arrived: protocol/parts.py; a
granted part holds its ring region). Completion is decided by resources, never by an
``is_last`` flag (docs/failure-modes.md #8): every writer reported its final count, that
many parts are Arrived (notification arrived, scattered), and none is Queued, Granted or
Scattering. Only a WRITE's notification (StagedPart /
PartDone) counts a part as arrived (docs/failure-modes.md #9).

The ring (docs/failure-modes.md #4-#7, #16): regions are granted per (room, writer, part),
re-granted
identically to a re-sent AllocRequest, queued FIFO when the ring is full (the writer gets a
Watermark), refused for good when larger than the ring (GrantRefused; only that request
fails, OversizedChunk). A region granted but unwritten for ``stall_s`` fails its request
(StalledWriter). When a request fails, regions a live writer may still write into are
QUARANTINED (kept occupied) until its late notification arrives, the writer is known dead,
or ``quarantine_grace_s`` passed; everything else is freed at once.

Pre-grants (protocol v5): a staged writer's RequestKV carries a region for its part 0 as large
as the writer's whole share of the request, granted at once when no allocation is queued and
live pre-grants stay within ``pregrant_share`` of the ring, so the first part skips the
AllocRequest / Grant round trip (by default on CUDA only, up to the whole ring:
``PREGRANT_SHARE``). Requests whose KV is still being computed never keep the ring from parts
already moving: when the queued part at the head does not fit, decode asks unwritten
pre-grants back, the latest granted first, until they and the largest free extent could hold
it (``Withdraw``, re-sent every ``grant_s``; ``pd_transfer_pregrants_total{outcome=
reclaimed}``); a writer that has posted its WRITE keeps its region. It is a
Granted part like any other (freed when scattered, quarantined when its request fails while
the writer lives) except that: its StagedPart may
be smaller than the region, whose tail is freed when it lands; no stall watchdog runs on it
(the writer may still be computing the KV: the transfer deadline bounds it); an AllocRequest
for it means the writer could not use it (it gives it back: the region is freed and the
request served as new); and a resize asks for it back (``Withdraw``, re-sent every
``grant_s``) so that a writer still computing does not hold the drain to its deadline.
Its scatter is prepared with the grant: the share's page and layer ids on the device, the
arguments checked, the kernel bound (``staging.prepare_scatter``), so a StagedPart that is
the whole share only launches it; any other part's scatter is prepared when its StagedPart
arrives (``pd_transfer_scatters_total{prepared=grant|notification}``).

Hot resize (``resize_ring(new_bytes, deadline_s)``): no new region is granted (new
AllocRequests queue FIFO, answered with a Watermark, bounded by their own deadlines);
granted regions finish (written, scattered, freed) until the deadline; a request still
holding a granted region then fails ResizeDeadline and the region is quarantined. The old
buffer is deregistered (and kept allocated while a quarantined region of it may still be
written), the new one allocated and registered, ``ring_version`` bumped and announced to
every prefill peer (``RingUpdate``); then the queue is served against the new ring. Grants
carry the version; a StagedPart of another version is a protocol violation (its request).
No pre-grant is given while a resize is under way.
"""

from __future__ import annotations

import base64
import collections
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from pd_transfer._endpoint import (
    Endpoint,
    PollIntervals,
    RankIdentity,
    ResizeResult,
    Timeouts,
    Transfer,
)
from pd_transfer._paths import PathMode, choose_path, compute_layout
from pd_transfer.auth import PeerAuth
from pd_transfer.bootstrap import RankDocument
from pd_transfer.errors import OversizedAllocation
from pd_transfer.layout import KVLayout, KVPool
from pd_transfer.metrics import TransferMetrics
from pd_transfer.phases import PhaseLog, Stamp
from pd_transfer.plan import TransferPlan, compute_transfer_topology
from pd_transfer.protocol import messages as wire
from pd_transfer.protocol.coverage import Coverage, CoverageError
from pd_transfer.protocol.lifecycle import Event, FailureReason, Role, State
from pd_transfer.protocol.parts import Part, PartEvent, PartState, Quarantined
from pd_transfer.ring import Region, StagingRing
from pd_transfer.staging import (
    PageIds,
    PreparedMove,
    prepare_pages,
    prepare_scatter,
    staged_chunk_bytes,
)
from pd_transfer.transport.base import RegisteredRegion, Transport

__all__ = ["PREGRANT_SHARE", "DecodeReceiver"]

_log = logging.getLogger("pd_transfer")
#: The share of the ring live pre-grants may hold on CUDA (module docstring): all of it, since
#: a queued part that does not fit takes unwritten pre-grants back. A smaller share keeps the
#: rest for AllocRequests without that round trip. On CPU pre-grants are off by default: a CPU
#: transfer's copies take milliseconds, beside which the grant round trip is small.
PREGRANT_SHARE = 1.0


@dataclass(kw_only=True, eq=False)
class _InPart(Part):
    """One part coming from one writer (``region``: its granted ring region)."""

    side: Role = Role.DECODE
    granted_at: float = 0.0
    ring_version: int = 0  # of the ring its region was granted in
    scattered: torch.cuda.Event | None = None  # CUDA: fires when its scatter has finished
    pregranted: bool = False  # its region went out with the RequestKV (module docstring)
    prepared: PreparedMove | None = None  # a pre-grant's scatter of the whole share
    withdraw_sent_at: float | None = None  # asked for the pre-grant back (resize, queued part)
    stamps: dict[str, float] = field(default_factory=dict)  # Stamp -> clock (phases.py)


@dataclass
class _Writer:
    """One prefill rank writing into this decode rank for one request."""

    peer: str
    plan: TransferPlan
    layout: KVLayout  # the writer's local layout
    path: str
    asked_at: float
    coverage: Coverage  # the plan's layers × the request's pages its landed parts claimed
    heard: bool = False
    final: int | None = None
    parts: dict[int, _InPart] = field(default_factory=dict)  # every part a message named

    def part(self, index: int) -> _InPart:
        """Part ``index``; an Unseen one (not kept until it takes an event) if none yet."""
        part = self.parts.get(index)
        return part if part is not None else _InPart(index=index)

    def in_state(self, *states: PartState) -> list[_InPart]:
        return [p for p in self.parts.values() if p.state in states]

    def arrived(self) -> list[int]:
        return sorted(p.index for p in self.in_state(PartState.ARRIVED))


class ReceiveTransfer(Transfer):
    """All state of one request on one decode rank (see module docstring)."""

    role = Role.DECODE

    def __init__(
        self,
        receiver: DecodeReceiver,
        room: str,
        *,
        dst_pages: list[int],
        num_tokens: int,
        instance: str | None,
        mode: PathMode,
        first_page: int = 0,
    ) -> None:
        super().__init__(room, receiver.clock(), lambda: receiver._release(self))
        self.dst_pages = dst_pages
        self.dst_ids: PageIds | None = None  # dst_pages on the device (staged path)
        self.num_tokens = num_tokens
        self.first_page = first_page
        self.instance = instance
        self.mode = mode
        self.bootstrap_deadline = self.created + receiver.timeouts.bootstrap_s
        self.writers: dict[int, _Writer] = {}

    def bound_peers(self) -> list[str]:
        return [writer.peer for writer in self.writers.values()]


@dataclass(frozen=True)
class _Queued:
    """An AllocRequest waiting for ring space (served first in, first out)."""

    transfer: ReceiveTransfer
    writer: _Writer
    part: _InPart


class DecodeReceiver(Endpoint[ReceiveTransfer]):
    """One decode rank's receiving endpoint, with its staging ring (see module docstring)."""

    role = Role.DECODE
    staging_side = "ring"

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
        super().__init__(transport, pool, identity, auth=auth, timeouts=timeouts,
                         metrics=metrics, clock=clock, phases=phases, poll=poll)
        self.pregrant_share = pregrant_share
        self.mode: PathMode = mode
        self.ring_buffer = torch.zeros(ring_bytes, dtype=torch.uint8, device=pool.device)
        self.ring_region = transport.register(self.ring_buffer,
                                              name=f"{transport.agent_name}/ring")
        self.ring = StagingRing(ring_bytes)
        self.ring_version = 1
        self.metrics.attach_ring(self.ring)
        self.metrics.set_staging(ring_bytes, self.ring_version)
        self._queue: collections.deque[_Queued] = collections.deque()
        self._quarantine: list[Quarantined] = []
        self._retired: dict[int, torch.Tensor] = {}  # old ring buffers quarantine still pins

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

    def abort(self, room: str, detail: str = "aborted by the engine") -> Future[None]:
        return self.submit(lambda: self._abort(room, detail))

    def resize_ring(self, new_bytes: int, deadline_s: float) -> Future[ResizeResult]:
        """Re-size the staging ring to ``new_bytes`` without restarting (module docstring).

        The Future yields a ``ResizeResult`` once the new ring serves, or raises
        ``ResizeError`` (one already under way, bad size, registration failed: the old ring
        stays in force). Requests whose regions are still live after ``deadline_s`` fail
        ResizeDeadline; no other request fails because of the resize."""
        return self._request_resize(new_bytes, deadline_s)

    def debug_counts(self) -> dict[str, int]:
        """Sizes of every per-request structure (docs/failure-modes.md #11 tests compare to
        baseline)."""
        return {
            "transfers": len(self._transfers),
            "queued_allocations": len(self._queue),
            "quarantined": len(self._quarantine),
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
        transfer = ReceiveTransfer(self, room, dst_pages=pages, num_tokens=num_tokens,
                                   instance=instance, mode=mode, first_page=first_page)
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
            coverage = Coverage(range(plan.layers.start, plan.layers.stop),
                                len(transfer.dst_pages))
            transfer.writers[plan.sender_id] = _Writer(name, plan, src_layout, path, now,
                                                       coverage)
        transfer.instance = instance
        transfer.transfer_deadline = now + self.timeouts.transfer_s
        if any(writer.path == "staged" for writer in transfer.writers.values()):
            self._dst_ids(transfer)  # now, not when the first part lands
        self._apply(transfer, Event.START)
        for writer in transfer.writers.values():
            self._ask(transfer, writer)

    def _ask(self, transfer: ReceiveTransfer, writer: _Writer) -> None:
        writer.asked_at = self.clock()
        region = self._pregrant(transfer, writer)
        self.send(writer.peer, wire.RequestKV(
            room=transfer.room, decode_pp_rank=self.identity.coord.pp_rank,
            decode_tp_rank=self.identity.coord.tp_rank,
            dst_page_runs=wire.compute_runs(transfer.dst_pages), num_tokens=transfer.num_tokens,
            path=writer.path,  # type: ignore[arg-type]
            ring_version=self.ring_version, first_page=transfer.first_page,
            pregrant_offset=None if region is None else region.offset_bytes,
            pregrant_bytes=None if region is None else region.size_bytes,
        ))

    def _pregrant(self, transfer: ReceiveTransfer, writer: _Writer) -> Region | None:
        """The region granted to ``writer``'s part 0 with its RequestKV (module docstring):
        granted now if the ring allows, the same one for a re-sent RequestKV, else None."""
        if writer.path != "staged" or self._resize is not None:
            return None
        part = writer.parts.get(0)
        if part is not None:  # asked before, or part 0 was named since
            return part.region if part.pregranted and part.state is PartState.GRANTED else None
        size = self._writer_share(transfer, writer)
        if self._queue or self._pregranted_bytes() + size > (
                self.ring.capacity_bytes * self.pregrant_share):
            return None
        try:
            region = self.ring.allocate(transfer.room, size)
        except OversizedAllocation:
            return None  # part 0 asks; the request fails then only if that part cannot fit
        if region is None:
            return None
        part = writer.part(0)
        part.size_bytes, part.pregranted = size, True
        part.region, part.granted_at, part.ring_version = region, self.clock(), self.ring_version
        self._move(writer, part, PartEvent.GRANT)
        part.stamps[Stamp.PREGRANTED] = part.granted_at
        part.prepared = self._prepare_scatter(transfer, writer, region, *self._share_ranges(
            transfer, writer))
        self.metrics.pregrant("granted")
        return region

    def _pregranted_bytes(self) -> int:
        """Ring bytes held by pre-grants, written or not (the scatter may still read them)."""
        return sum(part.region.size_bytes for _, _, part in self._pregrants()
                   if part.region is not None)

    def _pregrants(self) -> list[tuple[ReceiveTransfer, _Writer, _InPart]]:
        """Every pre-granted part still holding its region (only ever a writer's part 0)."""
        return [(transfer, writer, part)
                for transfer in self._transfers.values()
                for writer in transfer.writers.values()
                if (part := writer.parts.get(0)) is not None and part.pregranted
                and part.region is not None]

    def _writer_share(self, transfer: ReceiveTransfer, writer: _Writer) -> int:
        """Staged bytes of ``writer``'s whole share of the request: no part is larger."""
        return staged_chunk_bytes(self.pool.layout, writer.plan.layers.count,
                                  len(transfer.dst_pages), writer.plan.heads.num_heads)

    def _give_back(self, writer: _Writer, part: _InPart) -> None:
        """``part``'s writer gave its pre-grant back unwritten: free the region, forget it."""
        assert part.pregranted and part.region is not None
        self.ring.free(part.region)
        part.region = None
        self.part_machine.apply(part, PartEvent.WITHDRAW)
        del writer.parts[part.index]
        self.metrics.pregrant("returned")

    def _on_peer_added(self, document: RankDocument) -> None:
        if self.ring_version > 1 and document.role == "prefill":
            self.send(document.agent_name, self._ring_update())  # it may hold an older doc
        for transfer in list(self._transfers.values()):
            if transfer.lifecycle.state is State.BOOTSTRAPPING:
                with self.guard(self._failer(transfer)):
                    self._bootstrap(transfer)

    # Messages ------------------------------------------------------------------------------

    def _on_message(self, peer: str, message: wire.Message) -> None:
        if isinstance(message, wire.RequestKV | wire.Grant | wire.GrantRefused | wire.Release
                      | wire.Watermark | wire.RingUpdate | wire.Withdraw):
            self.reject("wrong_direction", f"{message.type} from {peer} to a decode rank")
            return
        transfer = self._transfers.get(message.room)
        if transfer is None:
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
                self._on_alloc(transfer, writer, message)
            elif isinstance(message, wire.StagedPart):
                self._on_staged(transfer, writer, message)
            elif isinstance(message, wire.PartDone):
                self._on_part_done(transfer, writer, message)
            elif isinstance(message, wire.Withdrawn):
                self._on_withdrawn(writer)
            else:
                self._set_final(transfer, writer, message.final_parts)
            self._check_complete(transfer)

    def _on_unknown_room(self, peer: str, message: wire.Message) -> None:
        if isinstance(message, wire.StagedPart):  # a late write into a quarantined region?
            for entry in self._quarantine:
                # Its own room only: a written part's notification sent again (the writer
                # heard no Release) may name a region that another room holds since.
                if entry.region.owner == message.room and entry.matches(
                        peer, message.ring_offset, message.size_bytes, message.ring_version):
                    self._drop_quarantined(entry)
                    break
        if isinstance(message, wire.Withdrawn):  # a failed request's pre-grant, unwritten
            for entry in self._quarantine:
                if entry.pregranted and (entry.writer, entry.region.owner) == (peer, message.room):
                    self._drop_quarantined(entry)
                    return
        if isinstance(message, wire.AllocRequest) and peer in self.peers:
            self.send(peer, wire.Abort(room=message.room, reason="AbortedByPeer", detail="decode "
                                       "does not expect this room (finished or failed)"))
        room = getattr(message, "room", None)
        self.reject("unknown_room", f"{message.type} for {room!r} from {peer}")

    def _on_alloc(
        self, transfer: ReceiveTransfer, writer: _Writer, msg: wire.AllocRequest
    ) -> None:
        if writer.path != "staged":
            self.reject("wrong_path", f"AllocRequest on the {writer.path} path")
            return
        part = writer.part(msg.part)
        part.stamps.setdefault(Stamp.ALLOC_RECEIVED, self.clock())
        if part.state is PartState.ARRIVED:
            self.reject("duplicate", f"AllocRequest for delivered part {msg.part}")
            return
        if part.state is PartState.GRANTED and part.pregranted:
            self._give_back(writer, part)  # the writer could not use it (module docstring)
            part = writer.part(msg.part)
            part.stamps[Stamp.ALLOC_RECEIVED] = self.clock()
        if part.state is PartState.GRANTED:  # a re-sent request: the same grant again
            if self.ring_version > 1:  # the writer may have missed the RingUpdate it needs
                self.send(writer.peer, self._ring_update())
            self.send(writer.peer, self._grant(transfer, writer, part))
            return
        if part.state in (PartState.QUEUED, PartState.SCATTERING):
            self.send(writer.peer, self._watermark(transfer, writer, msg.part))
            return
        if writer.final is not None and msg.part >= writer.final:
            self._violation(transfer, writer.peer, f"part {msg.part} beyond final {writer.final}")
            return
        most = self._writer_share(transfer, writer)
        if msg.size_bytes > most:
            self._violation(transfer, writer.peer, f"AllocRequest of {msg.size_bytes} bytes; "
                            f"the whole request is at most {most}")
            return
        part.size_bytes = msg.size_bytes
        if self._resize is not None:  # no new grants while a resize drains the ring
            self._enqueue(transfer, writer, part)
            return
        try:
            region = self.ring.allocate(transfer.room, msg.size_bytes)
        except OversizedAllocation as exc:
            self._refuse(transfer, writer, part, exc)
            return
        if region is None:
            self._enqueue(transfer, writer, part)
            return
        self._give(transfer, writer, part, region)

    def _give(self, transfer: ReceiveTransfer, writer: _Writer, part: _InPart,
              region: Region) -> None:
        """Grant ``region`` to ``part`` and tell its writer."""
        part.region, part.granted_at, part.ring_version = region, self.clock(), self.ring_version
        self._move(writer, part, PartEvent.GRANT)
        self.send(writer.peer, self._grant(transfer, writer, part))
        part.stamps[Stamp.GRANT_SENT] = self.clock()

    def _enqueue(self, transfer: ReceiveTransfer, writer: _Writer, part: _InPart) -> None:
        """No ring space for ``part`` now: queue it (FIFO), tell its writer it waits."""
        self._move(writer, part, PartEvent.QUEUE)
        self._queue.append(_Queued(transfer, writer, part))
        self.metrics.set_pending_allocations(len(self._queue))
        self.send(writer.peer, self._watermark(transfer, writer, part.index))

    def _refuse(self, transfer: ReceiveTransfer, writer: _Writer, part: _InPart,
                exc: OversizedAllocation) -> None:
        """``part`` can never fit the ring: GrantRefused, and only its request fails."""
        self._move(writer, part, PartEvent.REFUSE)
        self.send(writer.peer, wire.GrantRefused(
            room=transfer.room, part=part.index, sender_id=writer.plan.sender_id,
            needed_bytes=part.size_bytes, capacity_bytes=self.ring.capacity_bytes))
        self._fail(transfer, FailureReason.OVERSIZED_CHUNK, str(exc), skip_peer=writer.peer)

    def _on_withdrawn(self, writer: _Writer) -> None:
        part = writer.parts.get(0)
        if part is None or not (part.pregranted and part.state is PartState.GRANTED):
            # Its AllocRequest gave it back first, or it was written: nothing is held.
            self.reject("duplicate", f"Withdrawn from {writer.peer}: no pre-grant is held")
            return
        self._give_back(writer, part)

    def _move(self, writer: _Writer, part: _InPart, event: PartEvent) -> None:
        """``event`` for ``part`` through the part-state table; the writer keeps the part."""
        self.part_machine.apply(part, event)
        writer.parts[part.index] = part

    def _on_staged(
        self, transfer: ReceiveTransfer, writer: _Writer, msg: wire.StagedPart
    ) -> None:
        part = writer.part(msg.part)
        notified = self.clock()
        if part.state in (PartState.SCATTERING, PartState.ARRIVED):
            self.reject("duplicate", f"notification for part {msg.part} again")
            return
        if msg.ring_version != self.ring_version:  # every live grant is of the current ring
            self.reject("stale_registration", f"part {msg.part}: ring version "
                        f"{msg.ring_version}, the ring in force is {self.ring_version}")
            self._violation(transfer, writer.peer, f"StagedPart for ring version "
                            f"{msg.ring_version} (in force: {self.ring_version})")
            return
        region = part.region
        if part.state is not PartState.GRANTED or region is None:
            self._violation(transfer, writer.peer,
                            f"notification for part {msg.part}, never granted")
            return
        plan = writer.plan
        layers = range(msg.layer_start, msg.layer_stop)
        pages = range(msg.page_start, msg.page_start + msg.page_count)
        if not self._claim(transfer, writer, msg, layers, pages):
            return
        expected = staged_chunk_bytes(self.pool.layout, len(layers), len(pages),
                                      plan.heads.num_heads)
        # A pre-granted region holds the writer's whole share; any other its part's size.
        fits = (msg.size_bytes <= region.size_bytes if part.pregranted
                else msg.size_bytes == region.size_bytes)
        if msg.ring_offset != region.offset_bytes or not fits or expected != msg.size_bytes:
            self.reject("region_mismatch", f"part {msg.part}: [{msg.ring_offset}, "
                        f"+{msg.size_bytes}) layers {layers} pages {pages}; granted "
                        f"[{region.offset_bytes}, +{region.size_bytes}), {expected} expected")
            self._violation(transfer, writer.peer, "notification does not match its grant")
            return
        self.part_machine.apply(part, PartEvent.LAND)
        part.stamps[Stamp.NOTIFIED] = notified
        if msg.size_bytes < region.size_bytes:  # the unwritten tail of a pre-grant: free now
            region = part.region = self.ring.shrink(region, msg.size_bytes)
            assert region is not None  # a Granted part's region is live
        if part.pregranted:
            self.metrics.pregrant("used")
        move, part.prepared = part.prepared, None
        if move is not None and (layers, pages) == self._share_ranges(transfer, writer):
            self.metrics.scatter_launched("grant")
        else:
            move = self._prepare_scatter(transfer, writer, region, layers, pages)
            self.metrics.scatter_launched("notification")
        move.launch(None if self._stream is None else self._stream.stream)
        if self._stream is not None:
            part.scattered = self._stream.record()
        part.stamps[Stamp.SCATTER_QUEUED] = self.clock()
        if self._stream is None:  # CPU: the copy ran in the launch
            self._landed(transfer, writer, part)

    @staticmethod
    def _share_ranges(transfer: ReceiveTransfer, writer: _Writer) -> tuple[range, range]:
        """``writer``'s whole share of the request: its plan's layers × every page."""
        return (range(writer.plan.layers.start, writer.plan.layers.stop),
                range(len(transfer.dst_pages)))

    def _prepare_scatter(
        self, transfer: ReceiveTransfer, writer: _Writer, region: Region, layers: range,
        pages: range,
    ) -> PreparedMove:
        """The scatter of ``region`` (``layers`` in the plan's numbering × ``pages`` of the
        request) into the pool, checked, its ids on the device and its kernel bound: the
        launch is then O(1) host work. A pre-grant's is prepared with the grant."""
        plan = writer.plan
        first = plan.dst_layer_start - plan.layers.start
        view = self.ring_buffer[region.offset_bytes : region.offset_bytes + region.size_bytes]
        return prepare_scatter(view, self.pool, range(layers.start + first, layers.stop + first),
                               self._dst_ids(transfer).select(pages.start, pages.stop),
                               head_start=plan.heads.dst_head_offset,
                               num_heads=plan.heads.num_heads)

    def _dst_ids(self, transfer: ReceiveTransfer) -> PageIds:
        """The request's destination pages on the pool's device, made once (when the
        request starts). CUDA: the scatters' stream is then ordered after everything the
        engine queued on its default stream so far, which includes the last kernels of
        these pages' previous owners; once per request, since the engine queues nothing on
        the pages while they load."""
        if transfer.dst_ids is None:
            transfer.dst_ids = prepare_pages(self.pool, transfer.dst_pages)
            if self._stream is not None:
                self._stream.order()
        return transfer.dst_ids

    def _landed(self, transfer: ReceiveTransfer, writer: _Writer, part: _InPart) -> None:
        region, part.region = part.region, None
        assert region is not None
        self.ring.free(region)
        self.part_machine.apply(part, PartEvent.SCATTERED)
        part.stamps[Stamp.SCATTERED] = self.clock()
        self._part_finished(transfer, writer.peer, writer.plan.sender_id, part.index,
                            "staged", region.size_bytes, part.stamps)
        transfer.bytes += region.size_bytes
        self.metrics.bytes_moved("staged", region.size_bytes)

    def _on_part_done(
        self, transfer: ReceiveTransfer, writer: _Writer, msg: wire.PartDone
    ) -> None:
        if writer.path == "staged":
            self._violation(transfer, writer.peer, "PartDone on the staged path")
            return
        part = writer.part(msg.part)
        if part.state is PartState.ARRIVED:
            self.reject("duplicate", f"notification for part {msg.part} again")
            return
        layers = range(msg.layer_start, msg.layer_stop)
        pages = range(msg.page_start, msg.page_start + msg.page_count)
        if self._claim(transfer, writer, msg, layers, pages):
            self._move(writer, part, PartEvent.NOTIFY)
            part.stamps[Stamp.NOTIFIED] = self.clock()
            size = (writer.plan.num_parts * writer.plan.bytes_per_token_per_layer
                    * len(layers) * len(pages) * self.pool.layout.page_size)
            self._part_finished(transfer, writer.peer, writer.plan.sender_id, part.index,
                                writer.path, size, part.stamps)

    def _claim(self, transfer: ReceiveTransfer, writer: _Writer,
               msg: wire.StagedPart | wire.PartDone, layers: range, pages: range) -> bool:
        """Check a landing part against the plan (docs/failure-modes.md #28): its final count
        agrees, its index is below it, its cells are inside the writer's promise and none
        landed before; then they count as covered. False: a counted violation failed the
        request (nothing claimed)."""
        if msg.final_parts is not None:
            self._set_final(transfer, writer, msg.final_parts)
            if transfer.lifecycle.finished:
                return False
        if writer.final is not None and msg.part >= writer.final:
            self._violation(transfer, writer.peer, f"part {msg.part} landed but the writer's "
                            f"final part count is {writer.final} (parts 0..{writer.final - 1})")
            return False
        try:
            writer.coverage.claim(layers, pages)
        except CoverageError as exc:
            self._violation(transfer, writer.peer, f"part {msg.part}: {exc}")
            return False
        return True

    def _set_final(self, transfer: ReceiveTransfer, writer: _Writer, final: int) -> None:
        beyond = sorted(p for p in writer.parts if p >= final)  # queued, granted or landed
        if (writer.final not in (None, final)) or beyond:
            self._violation(transfer, writer.peer, f"final part count {final} conflicts with "
                            f"{writer.final} / parts already named {beyond[-3:]}")
            return
        writer.final = final

    def _grant(self, transfer: ReceiveTransfer, writer: _Writer, part: _InPart) -> wire.Grant:
        assert part.region is not None
        return wire.Grant(room=transfer.room, part=part.index, sender_id=writer.plan.sender_id,
                          ring_offset=part.region.offset_bytes, size_bytes=part.region.size_bytes,
                          ring_version=self.ring_version)

    def _watermark(
        self, transfer: ReceiveTransfer, writer: _Writer, part: int
    ) -> wire.Watermark:
        return wire.Watermark(
            used_bytes=self.ring.used_bytes, capacity_bytes=self.ring.capacity_bytes,
            largest_free_bytes=self.ring.largest_free_extent_bytes,
            pending_allocations=len(self._queue), room=transfer.room, part=part,
            sender_id=writer.plan.sender_id)

    # Progress, deadlines, endings ------------------------------------------------------------

    def _moving(self) -> bool:
        """A writer has started sending (a part was named) or holds a pre-grant it may WRITE
        into at any moment: more messages, WRITEs and scatters are due."""
        return bool(self._queue) or any(any(w.parts for w in t.writers.values())
                                         for t in self._transfers.values())

    def _progress(self) -> bool:
        busy = False
        for transfer in list(self._transfers.values()):
            with self.guard(self._failer(transfer)):
                for writer in list(transfer.writers.values()):
                    for part in writer.in_state(PartState.SCATTERING):
                        event = part.scattered
                        if event is not None and event.query():  # type: ignore[no-untyped-call]
                            self._landed(transfer, writer, part)
                            busy = True
                if busy:
                    self._check_complete(transfer)
        if self._resize is not None:
            self._withdraw_pregrants()
        if self._resize is not None and not self._step_resize():
            return busy  # still draining: nothing is granted meanwhile
        return self._serve_queue() or busy

    def _withdraw_pregrants(self) -> None:
        """A resize drains the ring: ask each writer holding an unwritten pre-grant to give
        it back (``Withdraw``, again every ``grant_s`` until it lands or returns)."""
        now = self.clock()
        for transfer, writer, part in self._live_pregrants():
            self._withdraw(transfer, writer, part, now)

    def _withdraw(self, transfer: ReceiveTransfer, writer: _Writer, part: _InPart,
                  now: float) -> bool:
        """Ask ``writer`` for its pre-grant back, unless asked within ``grant_s``; True if
        asked now for the first time."""
        sent = part.withdraw_sent_at
        if sent is not None and now - sent < self.timeouts.grant_s:
            return False
        part.withdraw_sent_at = now
        self.send(writer.peer, wire.Withdraw(room=transfer.room,
                                             sender_id=writer.plan.sender_id))
        return sent is None

    def _serve_queue(self) -> bool:
        """Grant queued allocations in arrival order while the ring has room (FIFO: a big
        part at the head is not starved by smaller ones behind it). Nothing while a resize
        is under way."""
        served = False
        while self._queue and self._resize is None:
            queued = self._queue[0]
            try:
                region = self.ring.allocate(queued.transfer.room, queued.part.size_bytes)
            except OversizedAllocation as exc:  # queued before a shrink: it no longer fits
                self._queue.popleft()
                with self.guard(self._failer(queued.transfer)):
                    self._refuse(queued.transfer, queued.writer, queued.part, exc)
                served = True
                continue
            if region is None:
                self._reclaim_pregrants(queued.part.size_bytes)
                break
            self._queue.popleft()
            with self.guard(self._failer(queued.transfer)):
                self._give(queued.transfer, queued.writer, queued.part, region)
            served = True
        self.metrics.set_pending_allocations(len(self._queue))
        return served

    def _reclaim_pregrants(self, needed_bytes: int) -> None:
        """A queued part does not fit: ask for unwritten pre-grants back (``Withdraw``, the
        latest granted first, again every ``grant_s``) until they and the largest free
        extent could hold ``needed_bytes`` (module docstring). A writer whose WRITE is
        posted keeps its region; its StagedPart frees it when it lands."""
        now = self.clock()
        reclaimable = self.ring.largest_free_extent_bytes
        latest_first = sorted(reversed(self._live_pregrants()),  # ties: the later request
                              key=lambda held: -held[2].granted_at)
        for transfer, writer, part in latest_first:
            if reclaimable >= needed_bytes:
                return
            assert part.region is not None
            reclaimable += part.region.size_bytes
            if self._withdraw(transfer, writer, part, now):
                self.metrics.pregrant("reclaimed")

    def _live_pregrants(self) -> list[tuple[ReceiveTransfer, _Writer, _InPart]]:
        """Every pre-grant a writer may still WRITE into."""
        return [held for held in self._pregrants() if held[2].state is PartState.GRANTED]

    def _check_deadlines(self, now: float) -> None:
        for entry in [e for e in self._quarantine if e.expiry <= now]:
            self._drop_quarantined(entry)
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

    def _check_complete(self, transfer: ReceiveTransfer) -> None:
        if transfer.lifecycle.state is not State.TRANSFERRING:
            return
        for writer in transfer.writers.values():
            if writer.final is None or writer.arrived() != list(range(writer.final)) or (
                    writer.in_state(PartState.QUEUED, PartState.GRANTED, PartState.SCATTERING)):
                return
        for writer in transfer.writers.values():
            if not writer.coverage.complete:  # every part landed, yet cells are missing
                self._violation(transfer, writer.peer, f"all {writer.final} parts landed but "
                                f"{writer.coverage.missing()} were never written")
                return
        slots = len(transfer.dst_pages) * self.pool.layout.page_size
        for writer in transfer.writers.values():
            if writer.path != "staged":  # direct WRITEs: whole pages of the plan's layers
                transfer.bytes += writer.plan.bytes_per_token * slots
                self.metrics.bytes_moved(writer.path, writer.plan.bytes_per_token * slots)
        self._apply(transfer, Event.COMPLETE)
        for writer in transfer.writers.values():
            self.send(writer.peer, wire.Release(room=transfer.room))

    def _release(self, transfer: ReceiveTransfer) -> None:
        """Terminal: free or quarantine every region, drop queued allocations. Runs once."""
        self._transfers.pop(transfer.room, None)
        if any(q.transfer is transfer for q in self._queue):
            self._queue = collections.deque(q for q in self._queue if q.transfer is not transfer)
        expiry = self.clock() + self.timeouts.quarantine_grace_s
        for writer in transfer.writers.values():
            for part in writer.in_state(PartState.SCATTERING):
                if part.scattered is not None:
                    part.scattered.synchronize()  # this event, not the device: the scatter reads
                if part.region is not None:
                    self.ring.free(part.region)
            for part in writer.in_state(PartState.GRANTED):
                assert part.region is not None
                if writer.peer in self.peers and self.ring.quarantine(part.region):
                    self._quarantine.append(Quarantined(part.region, writer.peer, expiry,
                                                        part.ring_version, part.pregranted))
            writer.parts.clear()
        self.ring.free_owner(transfer.room)
        self._serve_queue()

    def _on_peer_lost(self, peer: str, detail: str) -> None:
        for entry in [e for e in self._quarantine if e.writer == peer]:
            self._drop_quarantined(entry)  # a dead writer writes nothing more
        for transfer in list(self._transfers.values()):
            if any(w.peer == peer for w in transfer.writers.values()):
                self._fail(transfer, FailureReason.PEER_UNREACHABLE, detail, skip_peer=peer)

    def _drop_quarantined(self, entry: Quarantined) -> None:
        """Release a quarantined region: in the ring in force, or of a retired ring (whose
        buffer is freed once none of its regions may still be written)."""
        self._quarantine.remove(entry)
        version = entry.ring_version
        if version == self.ring_version:
            self.ring.release_quarantined(entry.region)
        elif all(e.ring_version != version for e in self._quarantine):
            self._retired.pop(version, None)

    # Resize ----------------------------------------------------------------------------------

    def _staging_pool(self) -> StagingRing:
        return self.ring

    def _staging_version(self) -> int:
        return self.ring_version

    def _holds_staging(self, transfer: ReceiveTransfer) -> bool:
        return any(w.in_state(PartState.GRANTED, PartState.SCATTERING)
                   for w in transfer.writers.values())

    def _swap_staging(self, new_bytes: int) -> None:
        # Uninitialised: every region is written before it is read, and a zero-fill would
        # be a kernel that a peer's WRITE into the new buffer does not wait for.
        new_buffer = torch.empty(new_bytes, dtype=torch.uint8, device=self.pool.device)
        old_buffer, old_region, version = self.ring_buffer, self.ring_region, self.ring_version
        name = f"{self.transport.agent_name}/ring-v{version + 1}"
        self.transport.deregister(old_region)
        try:
            region = self.transport.register(new_buffer, name=name)
        except Exception:
            self.ring_region = self.transport.register(old_buffer, name=old_region.name)
            raise
        if any(e.ring_version == version for e in self._quarantine):
            self._retired[version] = old_buffer  # a late write may still land in it
        self.ring_buffer, self.ring_region = new_buffer, region
        self.ring = StagingRing(new_bytes)
        self.ring_version = version + 1
        self.metrics.attach_ring(self.ring)
        update = self._ring_update()
        for name_, document in list(self.peers.items()):
            if document.role == "prefill":
                self.send(name_, update)

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
