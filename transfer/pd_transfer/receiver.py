"""The decode side: ``DecodeReceiver`` asks prefill ranks for a request's KV and lands it.

Engine API (any thread; calls return Futures resolved on the worker thread):
``expect(room, page_ids, num_tokens, prefill_instance=None, mode=None)`` → ``poll(room)``
until ``finished``; ``abort(room)``. The pages may be read once the status is Succeeded.

One ``ReceiveTransfer`` per request owns all of its state: per expected writer (a prefill
rank, by sender id) its plan and path, its final part count once known, the parts whose
notification arrived, its granted ring regions and queued allocations. Completion is
decided by resources, never by an ``is_last`` flag (FAILURES #8): every writer reported
its final count, every part's notification arrived and was scattered, and the request
holds no ring region and no queued allocation. Only a WRITE's notification (StagedPart /
PartDone) counts a part as arrived (FAILURES #9).

The ring (FAILURES #4-#7, #16): regions are granted per (room, writer, part), re-granted
identically to a re-sent AllocRequest, queued FIFO when the ring is full (the writer gets a
Watermark), refused for good when larger than the ring (GrantRefused; only that request
fails, OversizedChunk). A region granted but unwritten for ``stall_s`` fails its request
(StalledWriter). When a request fails, regions a live writer may still write into are
QUARANTINED (kept occupied) until its late notification arrives, the writer is known dead,
or ``quarantine_grace_s`` passed; everything else is freed at once.

Hot resize (``resize_ring(new_bytes, deadline_s)``): no new region is granted (new
AllocRequests queue FIFO, answered with a Watermark, bounded by their own deadlines);
granted regions finish (written, scattered, freed) until the deadline; a request still
holding a granted region then fails ResizeDeadline and the region is quarantined. The old
buffer is deregistered (and kept allocated while a quarantined region of it may still be
written), the new one allocated and registered, ``ring_version`` bumped and announced to
every prefill peer (``RingUpdate``); then the queue is served against the new ring. Grants
carry the version; a StagedPart of another version is a protocol violation (its request).
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

from pd_transfer._endpoint import Endpoint, RankIdentity, ResizeResult, Timeouts
from pd_transfer._paths import PathMode, choose_path, compute_layout
from pd_transfer.bootstrap import RankDocument
from pd_transfer.errors import OversizedAllocation
from pd_transfer.layout import KVLayout, KVPool
from pd_transfer.metrics import TransferMetrics
from pd_transfer.plan import TransferPlan, compute_transfer_topology
from pd_transfer.protocol.lifecycle import (
    Event,
    FailureReason,
    Lifecycle,
    RequestStatus,
    Role,
    State,
)
from pd_transfer.protocol.messages import (
    Abort,
    AllocRequest,
    Grant,
    GrantRefused,
    Message,
    PartDone,
    Release,
    RequestKV,
    RingUpdate,
    StagedPart,
    Watermark,
    compute_runs,
)
from pd_transfer.ring import Region, StagingRing
from pd_transfer.staging import scatter, staged_chunk_bytes
from pd_transfer.transport.base import RegisteredRegion, Transport

__all__ = ["DecodeReceiver"]

_log = logging.getLogger("pd_transfer")


@dataclass
class _Writer:
    """One prefill rank writing into this decode rank for one request."""

    peer: str
    plan: TransferPlan
    layout: KVLayout  # the writer's local layout
    path: str
    asked_at: float
    heard: bool = False
    final: int | None = None
    arrived: set[int] = field(default_factory=set)
    grants: dict[int, tuple[Region, float]] = field(default_factory=dict)  # part → granted_at
    pending: dict[int, int] = field(default_factory=dict)  # part → size, queued for space
    scattering: dict[int, tuple[Region, torch.cuda.Event]] = field(default_factory=dict)


class ReceiveTransfer:
    """All state of one request on one decode rank (see module docstring)."""

    def __init__(
        self,
        receiver: DecodeReceiver,
        room: str,
        *,
        dst_pages: list[int],
        num_tokens: int,
        instance: str | None,
        mode: PathMode,
    ) -> None:
        self.room = room
        self.dst_pages = dst_pages
        self.num_tokens = num_tokens
        self.instance = instance
        self.mode = mode
        self.created = receiver.clock()
        self.bootstrap_deadline = self.created + receiver.timeouts.bootstrap_s
        self.transfer_deadline = float("inf")
        self.writers: dict[int, _Writer] = {}
        self.bytes = 0
        self.lifecycle = Lifecycle(lambda: receiver._release(self))

    def status(self, now: float) -> RequestStatus:
        return RequestStatus(
            self.room, Role.DECODE, self.lifecycle.state, self.lifecycle.reason,
            self.lifecycle.detail, self.bytes, now - self.created,
        )


class DecodeReceiver(Endpoint):
    """One decode rank's receiving endpoint, with its staging ring (see module docstring)."""

    role = Role.DECODE
    staging_side = "ring"

    def __init__(
        self,
        transport: Transport,
        pool: KVPool,
        identity: RankIdentity,
        *,
        ring_bytes: int,
        mode: PathMode = "auto",
        timeouts: Timeouts | None = None,
        metrics: TransferMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(transport, pool, identity, timeouts=timeouts, metrics=metrics,
                         clock=clock)
        self.mode: PathMode = mode
        self.ring_buffer = torch.zeros(ring_bytes, dtype=torch.uint8, device=pool.device)
        self.ring_region = transport.register(self.ring_buffer,
                                              name=f"{transport.agent_name}/ring")
        self.ring = StagingRing(ring_bytes)
        self.ring_version = 1
        self.metrics.attach_ring(self.ring)
        self.metrics.set_staging(ring_bytes, self.ring_version)
        self._stream: torch.cuda.Stream | None = None
        if pool.device.type == "cuda":
            self._stream = torch.cuda.Stream(pool.device)  # type: ignore[no-untyped-call]
        self._transfers: dict[str, ReceiveTransfer] = {}
        self._queue: collections.deque[tuple[str, int, int]] = collections.deque()
        # region, writer, expiry, ring version of the region
        self._quarantine: list[tuple[Region, str, float, int]] = []
        self._retired: dict[int, torch.Tensor] = {}  # old ring buffers quarantine still pins

    # Engine API ----------------------------------------------------------------------------

    def expect(
        self,
        room: str,
        page_ids: Sequence[int],
        num_tokens: int,
        *,
        prefill_instance: str | None = None,
        mode: PathMode | None = None,
    ) -> Future[None]:
        """Ask the prefill ranks of ``prefill_instance`` (the only one known, by default)
        for ``room``'s KV, into ``page_ids`` (request order)."""
        pages = [int(p) for p in page_ids]
        return self.submit(lambda: self._expect(room, pages, num_tokens, prefill_instance,
                                                mode or self.mode))

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
        """Sizes of every per-request structure (FAILURES #11 tests compare to baseline)."""
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
        mode: PathMode,
    ) -> None:
        layout = self.pool.layout
        if room in self._transfers:
            raise ValueError(f"room {room!r} is already expected")
        if not pages or num_tokens <= 0 or num_tokens > len(pages) * layout.page_size:
            raise ValueError(f"room {room!r}: {num_tokens} tokens do not fit {len(pages)} pages")
        if min(pages) < 0 or max(pages) >= layout.num_pages or len(set(pages)) != len(pages):
            raise ValueError(
                f"room {room!r}: page ids must be distinct, in [0, {layout.num_pages})")
        transfer = ReceiveTransfer(self, room, dst_pages=pages, num_tokens=num_tokens,
                                   instance=instance, mode=mode)
        self._transfers[room] = transfer
        self.metrics.request_started()
        self.publish(transfer.status(self.clock()))
        with self.guard(self._failer(transfer)):
            self._bootstrap(transfer)

    def _abort(self, room: str, detail: str) -> None:
        transfer = self._transfers.get(room)
        if transfer is not None:
            self._fail(transfer, FailureReason.ABORTED, detail)

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
            transfer.writers[plan.sender_id] = _Writer(name, plan, src_layout, path, now)
        transfer.instance = instance
        transfer.transfer_deadline = now + self.timeouts.transfer_s
        self._apply(transfer, Event.START)
        for writer in transfer.writers.values():
            self._ask(transfer, writer)

    def _ask(self, transfer: ReceiveTransfer, writer: _Writer) -> None:
        writer.asked_at = self.clock()
        self.send(writer.peer, RequestKV(
            room=transfer.room, decode_pp_rank=self.identity.coord.pp_rank,
            decode_tp_rank=self.identity.coord.tp_rank,
            dst_page_runs=compute_runs(transfer.dst_pages), num_tokens=transfer.num_tokens,
            path=writer.path,  # type: ignore[arg-type]
            ring_version=self.ring_version,
        ))

    def _on_peer_added(self, document: RankDocument) -> None:
        if self.ring_version > 1 and document.role == "prefill":
            self.send(document.agent_name, self._ring_update())  # it may hold an older doc
        for transfer in list(self._transfers.values()):
            if transfer.lifecycle.state is State.BOOTSTRAPPING:
                with self.guard(self._failer(transfer)):
                    self._bootstrap(transfer)

    # Messages ------------------------------------------------------------------------------

    def _on_message(self, peer: str, message: Message) -> None:
        if isinstance(message, RequestKV | Grant | GrantRefused | Release | Watermark
                      | RingUpdate):
            self.reject("wrong_direction", f"{message.type} from {peer} to a decode rank")
            return
        transfer = self._transfers.get(message.room)
        if transfer is None:
            self._on_unknown_room(peer, message)
            return
        sender_id = None if isinstance(message, Abort) else message.sender_id
        writer = transfer.writers.get(sender_id) if sender_id is not None else None
        if sender_id is not None and (writer is None or writer.peer != peer):
            self.reject("sender_mismatch", f"{peer} is not writer {sender_id} of "
                        f"{transfer.room!r}")
            return
        with self.guard(self._failer(transfer)):
            if isinstance(message, Abort):
                if any(w.peer == peer for w in transfer.writers.values()):
                    self._fail(transfer, FailureReason.ABORTED_BY_PEER,
                               f"prefill {peer}: {message.reason}: {message.detail}",
                               skip_peer=peer)
                else:
                    self.reject("sender_mismatch", f"Abort from {peer}, not a writer")
                return
            assert writer is not None
            writer.heard = True
            if isinstance(message, AllocRequest):
                self._on_alloc(transfer, writer, message)
            elif isinstance(message, StagedPart):
                self._on_staged(transfer, writer, message)
            elif isinstance(message, PartDone):
                self._on_part_done(transfer, writer, message)
            else:
                self._set_final(transfer, writer, message.final_parts)
            self._check_complete(transfer)

    def _on_unknown_room(self, peer: str, message: Message) -> None:
        if isinstance(message, StagedPart):  # a late write into a quarantined region?
            for entry in self._quarantine:
                region, writer, _, version = entry
                if (writer, region.offset_bytes, region.size_bytes, version) == (
                        peer, message.ring_offset, message.size_bytes, message.ring_version):
                    self._drop_quarantined(entry)
                    break
        if isinstance(message, AllocRequest) and peer in self.peers:
            self.send(peer, Abort(room=message.room, reason="AbortedByPeer",
                                  detail="decode does not expect this room (finished or failed)"))
        room = getattr(message, "room", None)
        self.reject("unknown_room", f"{message.type} for {room!r} from {peer}")

    def _on_alloc(self, transfer: ReceiveTransfer, writer: _Writer, msg: AllocRequest) -> None:
        if writer.path != "staged":
            self.reject("wrong_path", f"AllocRequest on the {writer.path} path")
            return
        if msg.part in writer.arrived:
            self.reject("duplicate", f"AllocRequest for delivered part {msg.part}")
            return
        granted = writer.grants.get(msg.part)
        if granted is not None:  # a re-sent request: the same grant again (idempotent)
            if self.ring_version > 1:  # the writer may have missed the RingUpdate it needs
                self.send(writer.peer, self._ring_update())
            self.send(writer.peer, self._grant(transfer, writer, msg.part, granted[0]))
            return
        if msg.part in writer.pending or msg.part in writer.scattering:
            self.send(writer.peer, self._watermark(transfer, writer, msg.part))
            return
        if writer.final is not None and msg.part >= writer.final:
            self._violation(transfer, writer, f"part {msg.part} beyond final {writer.final}")
            return
        most = staged_chunk_bytes(self.pool.layout, writer.plan.layers.count,
                                  len(transfer.dst_pages), writer.plan.heads.num_heads)
        if msg.size_bytes > most:
            self._violation(transfer, writer, f"AllocRequest of {msg.size_bytes} bytes; the "
                            f"whole request is at most {most}")
            return
        if self._resize is not None:  # no new grants while a resize drains the ring
            writer.pending[msg.part] = msg.size_bytes
            self._queue.append((transfer.room, msg.sender_id, msg.part))
            self.metrics.set_pending_allocations(len(self._queue))
            self.send(writer.peer, self._watermark(transfer, writer, msg.part))
            return
        try:
            region = self.ring.allocate(transfer.room, msg.size_bytes)
        except OversizedAllocation as exc:
            self.send(writer.peer, GrantRefused(
                room=transfer.room, part=msg.part, sender_id=msg.sender_id,
                needed_bytes=msg.size_bytes, capacity_bytes=self.ring.capacity_bytes))
            self._fail(transfer, FailureReason.OVERSIZED_CHUNK, str(exc), skip_peer=writer.peer)
            return
        if region is None:
            writer.pending[msg.part] = msg.size_bytes
            self._queue.append((transfer.room, msg.sender_id, msg.part))
            self.metrics.set_pending_allocations(len(self._queue))
            self.send(writer.peer, self._watermark(transfer, writer, msg.part))
            return
        writer.grants[msg.part] = (region, self.clock())
        self.send(writer.peer, self._grant(transfer, writer, msg.part, region))

    def _on_staged(self, transfer: ReceiveTransfer, writer: _Writer, msg: StagedPart) -> None:
        if msg.part in writer.arrived or msg.part in writer.scattering:
            self.reject("duplicate", f"notification for part {msg.part} again")
            return
        if msg.ring_version != self.ring_version:  # every live grant is of the current ring
            self.reject("stale_registration", f"part {msg.part}: ring version "
                        f"{msg.ring_version}, the ring in force is {self.ring_version}")
            self._violation(transfer, writer, f"StagedPart for ring version {msg.ring_version}"
                            f" (in force: {self.ring_version})")
            return
        granted = writer.grants.get(msg.part)
        if granted is None:
            self._violation(transfer, writer, f"notification for part {msg.part}, never granted")
            return
        region = granted[0]
        plan = writer.plan
        layers = range(msg.layer_start, msg.layer_stop)
        pages = range(msg.page_start, msg.page_start + msg.page_count)
        expected = staged_chunk_bytes(self.pool.layout, len(layers), len(pages),
                                      plan.heads.num_heads)
        if (msg.ring_offset, msg.size_bytes) != (region.offset_bytes, region.size_bytes) or (
                expected != msg.size_bytes or not layers or layers.start < plan.layers.start
                or layers.stop > plan.layers.stop or pages.stop > len(transfer.dst_pages)):
            self.reject("region_mismatch", f"part {msg.part}: [{msg.ring_offset}, "
                        f"+{msg.size_bytes}) layers {layers} pages {pages}; granted "
                        f"[{region.offset_bytes}, +{region.size_bytes}), {expected} expected")
            self._violation(transfer, writer, "notification does not match its grant")
            return
        if msg.final_parts is not None:
            self._set_final(transfer, writer, msg.final_parts)
            if transfer.lifecycle.finished:
                return
        del writer.grants[msg.part]
        view = self.ring_buffer[region.offset_bytes : region.offset_bytes + region.size_bytes]
        local_layers = [g - plan.layers.start + plan.dst_layer_start for g in layers]
        dst_pages = transfer.dst_pages[pages.start : pages.stop]
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.pool.device))
            with torch.cuda.stream(self._stream):
                scatter(view, self.pool, local_layers, dst_pages,
                        head_start=plan.heads.dst_head_offset, num_heads=plan.heads.num_heads)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._stream)
            writer.scattering[msg.part] = (region, event)
        else:
            scatter(view, self.pool, local_layers, dst_pages,
                    head_start=plan.heads.dst_head_offset, num_heads=plan.heads.num_heads)
            self._landed(transfer, writer, msg.part, region)

    def _landed(
        self, transfer: ReceiveTransfer, writer: _Writer, part: int, region: Region
    ) -> None:
        self.ring.free(region)
        writer.arrived.add(part)
        transfer.bytes += region.size_bytes
        self.metrics.bytes_moved("staged", region.size_bytes)

    def _on_part_done(self, transfer: ReceiveTransfer, writer: _Writer, msg: PartDone) -> None:
        if writer.path == "staged":
            self._violation(transfer, writer, "PartDone on the staged path")
            return
        if msg.part in writer.arrived:
            self.reject("duplicate", f"notification for part {msg.part} again")
            return
        if msg.final_parts is not None:
            self._set_final(transfer, writer, msg.final_parts)
        writer.arrived.add(msg.part)

    def _set_final(self, transfer: ReceiveTransfer, writer: _Writer, final: int) -> None:
        if (writer.final not in (None, final)) or any(p >= final for p in writer.arrived):
            self._violation(transfer, writer, f"final part count {final} conflicts with "
                            f"{writer.final} / arrived {sorted(writer.arrived)[-3:]}")
            return
        writer.final = final

    def _grant(self, transfer: ReceiveTransfer, writer: _Writer, part: int,
               region: Region) -> Grant:
        return Grant(room=transfer.room, part=part, sender_id=writer.plan.sender_id,
                     ring_offset=region.offset_bytes, size_bytes=region.size_bytes,
                     ring_version=self.ring_version)

    def _watermark(self, transfer: ReceiveTransfer, writer: _Writer, part: int) -> Watermark:
        return Watermark(
            used_bytes=self.ring.used_bytes, capacity_bytes=self.ring.capacity_bytes,
            largest_free_bytes=self.ring.largest_free_extent_bytes,
            pending_allocations=len(self._queue), room=transfer.room, part=part,
            sender_id=writer.plan.sender_id)

    # Progress, deadlines, endings ------------------------------------------------------------

    def _progress(self) -> bool:
        busy = False
        for transfer in list(self._transfers.values()):
            for writer in list(transfer.writers.values()):
                for part, (region, event) in list(writer.scattering.items()):
                    if event.query():  # type: ignore[no-untyped-call]
                        del writer.scattering[part]
                        self._landed(transfer, writer, part, region)
                        busy = True
            if busy:
                self._check_complete(transfer)
        if self._resize is not None and not self._step_resize():
            return busy  # still draining: nothing is granted meanwhile
        return self._serve_queue() or busy

    def _serve_queue(self) -> bool:
        """Grant queued allocations in arrival order while the ring has room (FIFO: a big
        part at the head is not starved by smaller ones behind it). Nothing while a resize
        is under way."""
        served = False
        while self._queue and self._resize is None:
            room, sender_id, part = self._queue[0]
            transfer = self._transfers.get(room)
            writer = transfer.writers.get(sender_id) if transfer is not None else None
            if transfer is None or writer is None or part not in writer.pending:
                self._queue.popleft()
                continue
            try:
                region = self.ring.allocate(room, writer.pending[part])
            except OversizedAllocation as exc:  # queued before a shrink: it no longer fits
                self._queue.popleft()
                size = writer.pending.pop(part)
                self.send(writer.peer, GrantRefused(
                    room=room, part=part, sender_id=sender_id, needed_bytes=size,
                    capacity_bytes=self.ring.capacity_bytes))
                self._fail(transfer, FailureReason.OVERSIZED_CHUNK, str(exc),
                           skip_peer=writer.peer)
                served = True
                continue
            if region is None:
                break
            self._queue.popleft()
            del writer.pending[part]
            writer.grants[part] = (region, self.clock())
            self.send(writer.peer, self._grant(transfer, writer, part, region))
            served = True
        self.metrics.set_pending_allocations(len(self._queue))
        return served

    def _check_deadlines(self, now: float) -> None:
        for entry in [e for e in self._quarantine if e[2] <= now]:
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
            missing = {w.plan.sender_id: (w.final, len(w.arrived))
                       for w in transfer.writers.values()}
            self._fail(transfer, FailureReason.TRANSFER_TIMEOUT,
                       f"not complete within {self.timeouts.transfer_s} s; writers "
                       f"(final, arrived): {missing}")
            return
        for writer in transfer.writers.values():
            stalled = [p for p, (_, at) in writer.grants.items()
                       if now - at >= self.timeouts.stall_s]
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
            if (writer.final is None or len(writer.arrived) != writer.final or writer.grants
                    or writer.pending or writer.scattering):
                return
        slots = len(transfer.dst_pages) * self.pool.layout.page_size
        for writer in transfer.writers.values():
            if writer.path != "staged":  # direct WRITEs: whole pages of the plan's layers
                transfer.bytes += writer.plan.bytes_per_token * slots
                self.metrics.bytes_moved(writer.path, writer.plan.bytes_per_token * slots)
        self._apply(transfer, Event.COMPLETE)
        for writer in transfer.writers.values():
            self.send(writer.peer, Release(room=transfer.room))

    def _failer(self, transfer: ReceiveTransfer) -> Callable[[str], None]:
        """What ``guard`` calls when processing ``transfer`` raised: fail only it."""
        return lambda detail: self._fail(transfer, FailureReason.INTERNAL_ERROR, detail)

    def _violation(self, transfer: ReceiveTransfer, writer: _Writer, detail: str) -> None:
        self.reject("protocol_violation", f"{writer.peer}: {detail}")
        self._fail(transfer, FailureReason.PROTOCOL_VIOLATION, f"{writer.peer}: {detail}")

    def _fail(
        self, transfer: ReceiveTransfer, reason: FailureReason, detail: str,
        *, skip_peer: str | None = None, notify: bool = True,
    ) -> None:
        if transfer.lifecycle.finished:
            return
        if notify:
            for writer in transfer.writers.values():
                if writer.peer != skip_peer and writer.peer in self.peers:
                    self.send(writer.peer, Abort(room=transfer.room, reason=reason.value,
                                                 detail=detail[:1024]))
        self._apply(transfer, Event.FAIL, reason, detail)

    def _apply(self, transfer: ReceiveTransfer, event: Event,
               reason: FailureReason | None = None, detail: str = "") -> None:
        transfer.lifecycle.apply(event, reason, detail)
        now = self.clock()
        self.publish(transfer.status(now))
        if transfer.lifecycle.finished:
            self.metrics.request_finished(transfer.room, reason, detail, now - transfer.created)

    def _release(self, transfer: ReceiveTransfer) -> None:
        """Terminal: free or quarantine every region, drop queued allocations. Runs once."""
        self._transfers.pop(transfer.room, None)
        expiry = self.clock() + self.timeouts.quarantine_grace_s
        for writer in transfer.writers.values():
            for region, event in writer.scattering.values():
                event.synchronize()  # this one event, not the device: the scatter reads it
                self.ring.free(region)
            for region, _ in writer.grants.values():
                if writer.peer in self.peers and self.ring.quarantine(region):
                    self._quarantine.append((region, writer.peer, expiry, self.ring_version))
            writer.grants.clear()
            writer.scattering.clear()
            writer.pending.clear()
        self.ring.free_owner(transfer.room)
        self._serve_queue()

    def _on_peer_lost(self, peer: str, detail: str) -> None:
        for entry in [e for e in self._quarantine if e[1] == peer]:
            self._drop_quarantined(entry)  # a dead writer writes nothing more
        for transfer in list(self._transfers.values()):
            if any(w.peer == peer for w in transfer.writers.values()):
                self._fail(transfer, FailureReason.PEER_UNREACHABLE, detail, skip_peer=peer)

    def _abort_all(self, detail: str) -> None:
        for transfer in list(self._transfers.values()):
            self._fail(transfer, FailureReason.ABORTED, detail)
        self._cancel_resize(detail)

    def _drop_quarantined(self, entry: tuple[Region, str, float, int]) -> None:
        """Release a quarantined region: in the ring in force, or of a retired ring (whose
        buffer is freed once none of its regions may still be written)."""
        self._quarantine.remove(entry)
        version = entry[3]
        if version == self.ring_version:
            self.ring.release_quarantined(entry[0])
        elif all(e[3] != version for e in self._quarantine):
            self._retired.pop(version, None)

    # Resize ----------------------------------------------------------------------------------

    def _staging_pool(self) -> StagingRing:
        return self.ring

    def _staging_version(self) -> int:
        return self.ring_version

    def _fail_staging_holders(self, detail: str) -> int:
        failed = 0
        for transfer in list(self._transfers.values()):
            if any(w.grants or w.scattering for w in transfer.writers.values()):
                failed += 1
                self._fail(transfer, FailureReason.RESIZE_DEADLINE, detail)
        return failed

    def _swap_staging(self, new_bytes: int) -> None:
        new_buffer = torch.zeros(new_bytes, dtype=torch.uint8, device=self.pool.device)
        old_buffer, old_region, version = self.ring_buffer, self.ring_region, self.ring_version
        name = f"{self.transport.agent_name}/ring-v{version + 1}"
        self.transport.deregister(old_region)
        try:
            region = self.transport.register(new_buffer, name=name)
        except Exception:
            self.ring_region = self.transport.register(old_buffer, name=old_region.name)
            raise
        if any(e[3] == version for e in self._quarantine):
            self._retired[version] = old_buffer  # a late write may still land in it
        self.ring_buffer, self.ring_region = new_buffer, region
        self.ring = StagingRing(new_bytes)
        self.ring_version = version + 1
        self.metrics.attach_ring(self.ring)
        update = self._ring_update()
        for name_, document in list(self.peers.items()):
            if document.role == "prefill":
                self.send(name_, update)

    def _ring_update(self) -> RingUpdate:
        region = self.ring_region
        return RingUpdate(
            ring_version=self.ring_version, name=region.name, base_address=region.base_address,
            size_bytes=region.size_bytes, kind=region.kind.value, device_id=region.device_id,
            transport_metadata_b64=base64.b64encode(self.transport.local_metadata()).decode())

    def _ring_region(self) -> RegisteredRegion | None:
        return self.ring_region

    def _ring_version(self) -> int:
        return self.ring_version
