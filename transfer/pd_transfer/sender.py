"""The prefill side: ``PrefillSender`` pushes a request's KV into the decode ranks that ask.

Engine API (any thread; each call returns a Future resolved on the worker thread):
``register_request(room, page_ids, num_tokens)`` → ``send_part(room, pages=, layers=,
last=, ready_event=)`` (one or more; ``last=True`` on the final one) → ``poll(room)``
until ``finished``; ``abort(room)``. The engine may free a request's KV pages once its
status is finished (either way): nothing reads them after that.

One ``SendTransfer`` per request owns all of its state: the parts the engine gave, one
``_Stream`` per decode rank that sent a ``RequestKV`` (its plan, path, destination pages and
the parts in flight to it, each in one ``PartState`` of protocol/parts.py with its staging
region, grant and WRITE handle). A request SUCCEEDS when
every decode rank it serves has sent RequestKV, the last part was given, every WRITE is
DONE and every decode rank sent ``Release`` (it scattered everything). Deadlines: no
RequestKV within ``kv_lease_s`` → LeaseExpired (the KV hold has a lease, docs/failure-modes.md #18);
``transfer_s`` from the first RequestKV → TransferTimeout; an AllocRequest is re-sent every
``grant_s`` and after ``grant_retries`` unanswered re-sends → GrantTimeout. A stream whose
parts are all written but whose Release has not come within ``max(grant_s, stall_s / 4)``
sends the parts' notifications again as messages, at most ``grant_retries`` rounds
(``_renotify``: a WRITE's notification can be lost while its data landed).

Pre-grants (protocol v5): a staged RequestKV may carry ring bytes already granted to part 0,
checked when the stream opens (exactly the writer's whole share, inside the peer's ring, or
the request fails ProtocolViolation). Part 0 writes into them without an AllocRequest when
its ring version is in force; otherwise its AllocRequest gives them back. A ``Withdraw``
(decode resizing, or taking the region for a queued part) is answered with ``Withdrawn``
unless the WRITE is posted (a part that took the pre-grant but has not posted then asks with
an AllocRequest), and a request that fails holding an unwritten pre-grant sends ``Withdrawn``
so decode frees it without waiting out its quarantine.

Gathers on the engine's thread: a staged RequestKV that brings a pre-grant for a request
whose pages are all registered and whose engine has given no part yet makes the worker set
staging space aside for that decode rank's whole share and prepare its gather (``_arm``:
page and layer ids on the device, arguments checked). The engine's ``send_part`` of the
whole request (``last=True``, every page, every layer of this stage) then launches those
gathers itself, on the staging stream after a device-side wait for its ready event, and the
worker finds part 0 gathered and pre-granted: it only posts the WRITE, which it prepared when
it set the space aside (``Transport.prepare_write``: the sealed StagedPart, the descriptors
and NIXL's request; the post is then one backend call). Why: the engine's
thread launches kernels back to back, while the worker's first CUDA call after a wait costs
several times a hot launch, and host polling of the ready event is gone. Any other part
gives the space back (``_disarm``), as do a Withdraw, the request's end and a resize of this
buffer; a part whose pre-grant was withdrawn after its gather asks with an AllocRequest. On
by default on CUDA (``engine_thread_gathers``); counted in ``pd_transfer_gathers_total``.

A RequestKV for a room not registered yet is buffered for ``kv_lease_s`` (docs/failure-modes.md
#2): a router sends both halves at once, and a loaded engine may queue the prefill half for
seconds before its first chunk registers the room; the lease is how long either side of a
request may wait for the other.

Decode ring resizes: a ``RingUpdate`` from a decode peer replaces that peer's ring region,
registration version and transport metadata (kept per peer, so decode peers with different
pool sizes are served at once). A grant of an older version than the peer's ring in force is
refused; one of a newer version waits for its RingUpdate: nothing is ever written with an
older registration. ``resize_buffer(new_bytes, deadline_s)`` re-sizes this rank's own
staging buffer: no new gather starts, parts holding staging space finish until the deadline
(the rest fail ResizeDeadline), the buffer is re-registered, gathers resume.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pd_transfer._endpoint import (
    Endpoint,
    PollIntervals,
    RankIdentity,
    ResizeResult,
    Timeouts,
    Transfer,
)
from pd_transfer._paths import compute_contiguous_spans, compute_layout, compute_sliced_spans
from pd_transfer.auth import PeerAuth
from pd_transfer.bootstrap import RankDocument, RegionDoc
from pd_transfer.errors import (
    DescriptorError,
    OversizedAllocation,
    PeerUnreachable,
    TransportError,
)
from pd_transfer.layout import KVLayout, KVPool
from pd_transfer.metrics import TransferMetrics
from pd_transfer.phases import PhaseLog, Stamp
from pd_transfer.plan import (
    LayerRange,
    Parallelism,
    TransferPlan,
    TransferTopology,
    compute_stage_layers,
    compute_transfer_topology,
)
from pd_transfer.protocol import messages as wire
from pd_transfer.protocol.coverage import Coverage, CoverageError
from pd_transfer.protocol.lifecycle import Event, FailureReason, Role, State
from pd_transfer.protocol.parts import Part, PartEvent, PartState
from pd_transfer.ring import Region, StagingRing
from pd_transfer.staging import (
    PageIds,
    PreparedMove,
    gather,
    prepare_gather,
    prepare_pages,
    staged_chunk_bytes,
)
from pd_transfer.transport.base import (
    PreparedWrite,
    RegisteredRegion,
    Span,
    TransferHandle,
    TransferState,
    Transport,
)

__all__ = ["PrefillSender", "ReadyEvent"]

_log = logging.getLogger("pd_transfer")
MAX_EARLY_REQUESTS = 4096


class ReadyEvent(Protocol):
    """What ``send_part`` waits on before reading the KV: ``torch.cuda.Event`` fits."""

    def query(self) -> bool: ...


@dataclass(frozen=True)
class _Gathered:
    """A decode rank's whole share, gathered by the engine's thread in ``send_part``."""

    region: Region
    size_bytes: int
    event: torch.cuda.Event | None  # CUDA: fires when the gather has run
    enqueued_at: float


@dataclass(frozen=True)
class _PartSpec:
    """A part the engine gave: request pages ``pages`` x global layers ``layers``."""

    pages: range
    layers: LayerRange
    last: bool
    ready: ReadyEvent | None
    given_at: float  # the engine's send_part call
    early: Mapping[str, _Gathered] = field(default_factory=dict)  # by decode rank


@dataclass(frozen=True, eq=False)
class _EarlyGather:
    """Staging space set aside for one decode rank's whole share, and the gather into it
    that ``send_part`` launches on the engine's thread (module docstring)."""

    region: Region
    move: PreparedMove


@dataclass(frozen=True, eq=False)
class _PreparedShare:
    """The WRITE of an armed share (``_arm``): from ``region`` into the ``grant`` (the
    pre-grant), with the StagedPart of the whole share as its notification."""

    region: Region
    grant: wire.Grant
    write: PreparedWrite
    note: bytes  # its sealed StagedPart


@dataclass(frozen=True)
class _Armed:
    """A request's early gathers by decode rank, and the part that takes them: the whole
    request (every page, every layer of this stage) with ``last=True``."""

    total_pages: int
    stage: LayerRange
    gathers: dict[str, _EarlyGather]

    def covers(self, pages: range | None, layers: range | None) -> bool:
        return ((pages is None or (pages.step, pages.start, pages.stop) == (
                    1, 0, self.total_pages))
                and (layers is None or (layers.step, layers.start, layers.stop) == (
                    1, self.stage.start, self.stage.stop)))


@dataclass(kw_only=True, eq=False)
class _OutPart(Part):
    """One part on its way to one decode rank (numbered per decode rank; ``region``: its
    space in the staging buffer, staged path only)."""

    side: Role = Role.PREFILL
    spec: _PartSpec
    layers: LayerRange  # spec.layers within the plan's layers
    pages: range  # spec.pages from the decode rank's first page on (request indices)
    final: int | None  # final part count, attached to the writer's last part
    gathered: torch.cuda.Event | None = None
    grant: wire.Grant | None = None
    pregranted: bool = False  # ``grant`` is the RequestKV's pre-grant
    alloc_sent_at: float = 0.0
    retries: int = 0
    handle: TransferHandle | None = None
    note: bytes | None = None  # the sealed notification its WRITE carries
    stamps: dict[str, float] = field(default_factory=dict)  # Stamp -> clock (phases.py)


@dataclass
class _Stream:
    """A request's traffic to one decode rank."""

    peer: str
    document: RankDocument
    layout: KVLayout
    plan: TransferPlan
    path: str
    dst_pages: list[int]
    first_page: int = 0  # decode holds the request's pages before this one
    pregrant: wire.Grant | None = None  # from the RequestKV, for part 0 until it is taken
    next_spec: int = 0
    parts_made: int = 0
    final_sent: bool = False
    released: bool = False
    out: dict[int, _OutPart] = field(default_factory=dict)
    # The sealed notifications of the parts written, until decode's Release (``_renotify``).
    written: dict[int, bytes] = field(default_factory=dict)
    written_at: float = 0.0  # the last WRITE's DONE, or the last re-send
    renotified: int = 0  # rounds of re-sent notifications


class SendTransfer(Transfer):
    """All state of one request on one prefill rank (see module docstring)."""

    role = Role.PREFILL

    def __init__(
        self, sender: PrefillSender, room: str, src_pages: list[int], num_tokens: int
    ) -> None:
        super().__init__(room, sender.clock(), lambda: sender._release(self))
        self.src_pages = src_pages  # grows with extend_request (chunked prefill)
        self.src_ids: PageIds | None = None  # src_pages on the device (staged path)
        self.num_tokens = num_tokens
        self.total_pages = max(len(src_pages), -(-num_tokens // sender.pool.layout.page_size))
        self.lease_deadline = self.created + sender.timeouts.kv_lease_s
        self.specs: list[_PartSpec] = []
        stage = sender._stage_layers  # what the engine's parts must cover, each cell once
        self.coverage = Coverage(range(stage.start, stage.stop), self.total_pages)
        self.last_given = False
        self.instance: str | None = None
        self.expected: frozenset[tuple[int, int]] | None = None  # decode (pp, tp) coords
        self.streams: dict[str, _Stream] = {}

    def bound_peers(self) -> list[str]:
        return [stream.peer for stream in self.streams.values()]


class PrefillSender(Endpoint[SendTransfer]):
    """One prefill rank's sending endpoint (see module docstring)."""

    role = Role.PREFILL
    staging_side = "buffer"

    def __init__(self, transport: Transport, pool: KVPool, identity: RankIdentity, *,
                 auth: PeerAuth, staging_bytes: int, timeouts: Timeouts | None = None,
                 metrics: TransferMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 phases: PhaseLog | None = None, poll: PollIntervals | None = None,
                 engine_thread_gathers: bool | None = None) -> None:
        """``engine_thread_gathers``: whether ``send_part`` launches the gathers set aside
        for it (module docstring); default: on CUDA, where the engine's thread launches
        kernels back to back and the worker's first launch after a wait costs several
        times more. On CPU the gather would run on the engine's thread, so tests only."""
        super().__init__(transport, pool, identity, auth=auth, timeouts=timeouts,
                         metrics=metrics, clock=clock, phases=phases, poll=poll)
        self.engine_thread_gathers = (pool.device.type == "cuda" if engine_thread_gathers
                                      is None else engine_thread_gathers)
        # Rooms whose gathers wait for the engine's thread; the one lock the engine's thread
        # takes, held while it launches them so the worker never frees space being gathered.
        self._armed: dict[str, _Armed] = {}
        self._armed_lock = threading.Lock()
        self.staging_buffer = torch.zeros(staging_bytes, dtype=torch.uint8, device=pool.device)
        self.staging_region = transport.register(
            self.staging_buffer, name=f"{transport.agent_name}/staging"
        )
        self.staging = StagingRing(staging_bytes)
        self.staging_version = 1
        self.metrics.set_staging(staging_bytes, self.staging_version)
        self._stage_layers = compute_stage_layers(
            identity.geometry.num_layers, identity.parallelism.pp, identity.coord.pp_rank
        )
        self._early: dict[str, list[tuple[str, wire.RequestKV, float]]] = {}
        # Parts whose AllocRequest this step sent, gathered at its end (_enqueue_gathers).
        self._gathers: list[tuple[SendTransfer, _Stream, _OutPart, range]] = []
        # Armed shares' WRITEs, prepared with their gathers (worker thread only), by (room,
        # decode rank).
        self._writes: dict[tuple[str, str], _PreparedShare] = {}
        self.alloc_requests_sent = 0  # first sends only (docs/failure-modes.md #1 counts these)
        self.pregrants_taken = 0  # parts 0 written into their RequestKV's pre-grant instead
        self.prepared_writes_posted = 0  # parts 0 posted with the WRITE prepared at _arm

    # Engine API ----------------------------------------------------------------------------

    def register_request(
        self, room: str, page_ids: Sequence[int], num_tokens: int
    ) -> Future[None]:
        """Hold ``page_ids`` (the request's KV, in request order) for decode to claim. With
        chunked prefill the pages may be the first ones only; ``extend_request`` appends
        the rest as the engine allocates them, before the parts that send them."""
        pages = [int(p) for p in page_ids]
        return self.submit(lambda: self._register(room, pages, num_tokens))

    def extend_request(self, room: str, page_ids: Sequence[int]) -> Future[None]:
        """Append ``page_ids`` to a registered request's pages (in request order)."""
        pages = [int(p) for p in page_ids]
        return self.submit(lambda: self._extend(room, pages))

    def send_part(
        self,
        room: str,
        pages: range | None = None,
        layers: range | None = None,
        *,
        last: bool = False,
        ready_event: ReadyEvent | None = None,
    ) -> Future[None]:
        """Send request pages ``pages`` (indices into the registered page list; all by
        default) of global ``layers`` (this stage's by default) once ``ready_event`` fired.
        CUDA without one: the KV was written on the device's default stream, and the part is
        read after what that stream held at this call (an event recorded there now;
        docs/failure-modes.md #37)."""
        given = self.clock()
        if ready_event is None and self._stream is not None:
            ready_event = self._stream.mark_default()
        early = (self._gather_on_engine_thread(room, pages, layers, ready_event)
                 if last and self._armed else {})
        return self.submit(lambda: self._add_part(room, pages, layers, last, ready_event,
                                                  given, early))

    def abort(self, room: str, detail: str = "aborted by the engine") -> Future[None]:
        return self.submit(lambda: self._abort(room, detail))

    def resize_buffer(self, new_bytes: int, deadline_s: float) -> Future[ResizeResult]:
        """Re-size this rank's staging buffer to ``new_bytes`` without restarting (module
        docstring). The Future yields a ``ResizeResult`` or raises ``ResizeError`` (the old
        buffer then stays in force)."""
        return self._request_resize(new_bytes, deadline_s)

    def debug_counts(self) -> dict[str, int]:
        """Sizes of every per-request structure (docs/failure-modes.md #11 tests compare to
        baseline)."""
        with self._armed_lock:
            armed = sum(len(a.gathers) for a in self._armed.values())
        return {
            "transfers": len(self._transfers),
            "early_requests": sum(len(v) for v in self._early.values()),
            "staging_regions": self.staging.live_regions,
            "armed_gathers": armed,
            "prepared_writes": len(self._writes),
            **self.status_counts(),
        }

    # Gathers on the engine's thread (module docstring) ---------------------------------------

    def _gather_on_engine_thread(self, room: str, pages: range | None, layers: range | None,
                                 ready: ReadyEvent | None) -> dict[str, _Gathered]:
        """Launch ``room``'s armed gathers here if this part is the whole request: on CUDA
        the staging stream waits for ``ready`` on the device (no host poll). Called on the
        engine's thread, inside ``send_part``; {} leaves the part to the worker."""
        stream = self._stream
        wait = ready if isinstance(ready, torch.cuda.Event) else None
        if stream is None:
            if ready is not None and not ready.query():
                return {}  # CPU: the gather runs in this call, so the KV must be there
        elif wait is None:
            return {}  # an engine's own ReadyEvent: only the worker can poll it
        with self._armed_lock:
            armed = self._armed.get(room)
            if armed is None or not armed.covers(pages, layers):
                return {}
            del self._armed[room]
            try:
                if stream is not None and wait is not None:
                    stream.stream.wait_event(wait)
                for early in armed.gathers.values():
                    early.move.launch(stream.stream if stream is not None else None)
                event = stream.record() if stream is not None else None
            except Exception:  # the worker gathers it; the set-aside space goes at the end
                _log.exception("room %s: a gather on the engine's thread failed; the "
                               "transfer worker gathers the part", room)
                return {}
            at = self.clock()
        self.metrics.gathers_launched("engine", len(armed.gathers))
        return {peer: _Gathered(early.region, early.move.nbytes, event, at)
                for peer, early in armed.gathers.items()}

    def _arm(self, transfer: SendTransfer, stream: _Stream) -> None:
        """Set staging space aside for ``stream``'s whole share and prepare its gather, for
        the engine's thread to launch in ``send_part``: only while no part was given, with
        every page registered, a pre-grant of the peer's ring in force and no resize."""
        pregrant = stream.pregrant
        if (not self.engine_thread_gathers or stream.path != "staged" or pregrant is None
                or transfer.specs or self._resize is not None
                or len(transfer.src_pages) != transfer.total_pages
                or pregrant.ring_version != self._peer_document(stream).ring_version):
            return
        stage, plan = self._stage_layers, stream.plan
        layers = range(plan.layers.start - stage.start, plan.layers.stop - stage.start)
        pages = range(stream.first_page, transfer.total_pages)
        size = staged_chunk_bytes(self.pool.layout, len(layers), len(pages),
                                  plan.heads.num_heads)
        try:
            region = self.staging.allocate(transfer.room, size)
        except OversizedAllocation:
            return  # the worker's path fails the part with what to change
        if region is None:
            return  # the buffer is full now; the worker gathers it when space frees
        move = prepare_gather(
            self.pool, layers, self._src_ids(transfer).select(pages.start, pages.stop),
            head_start=plan.heads.src_head_offset, num_heads=plan.heads.num_heads,
            out=self.staging_buffer[region.offset_bytes : region.offset_bytes + size])
        if not move.compiled:  # a new kernel compiles on the worker, not in the engine's step
            self.staging.free(region)
            return
        note, local, remote, regions = self._staged_write(transfer, stream, 0, plan.layers,
                                                          pages, 1, pregrant,
                                                          region.offset_bytes, size)
        try:
            self._writes[transfer.room, stream.peer] = _PreparedShare(
                region, pregrant, self.transport.prepare_write(stream.peer, local, remote,
                                                               regions, note), note)
        except TransportError as exc:  # the part's own post meets it again and handles it
            _log.debug("room %s: no WRITE prepared for %s: %s", transfer.room, stream.peer, exc)
        with self._armed_lock:
            armed = self._armed.setdefault(transfer.room, _Armed(
                transfer.total_pages, stage, {}))
            armed.gathers[stream.peer] = _EarlyGather(region, move)

    def _disarm(self, room: str | None = None, peer: str | None = None) -> None:
        """Take back what the engine's thread has not taken: ``room``'s gathers (only
        ``peer``'s, if given), or every room's; their staging space is freed."""
        with self._armed_lock:
            rooms = [room] if room is not None else list(self._armed)
            taken: list[tuple[str, str, _EarlyGather]] = []
            for name in rooms:
                armed = self._armed.get(name)
                if armed is None:
                    continue
                for gone in [peer] if peer is not None else list(armed.gathers):
                    if (early := armed.gathers.pop(gone, None)) is not None:
                        taken.append((name, gone, early))
                if not armed.gathers:
                    del self._armed[name]
        for name, gone, early in taken:
            self.staging.free(early.region)
            self._discard_write(name, gone)

    def _discard_write(self, room: str, peer: str) -> None:
        """Free the WRITE prepared for ``room``'s share to ``peer``, if one is held."""
        held = self._writes.pop((room, peer), None)
        if held is not None:
            self.transport.discard(held.write)

    # Commands (worker thread) -------------------------------------------------------------

    def _register(self, room: str, pages: list[int], num_tokens: int) -> None:
        page_size = self.pool.layout.page_size
        if num_tokens > 0 and len(pages) * page_size < num_tokens:  # the first chunk's pages
            self._check_new(room, pages, len(pages) * page_size, "registered")
        else:
            self._check_new(room, pages, num_tokens, "registered")
        transfer = SendTransfer(self, room, pages, num_tokens)
        self._admit(transfer)
        decode_pars = {d.parallelism for d in self.peers.values() if d.role == "decode"}
        if len(decode_pars) == 1 and not self._topology(decode_pars.pop()).plans_from(
            self.identity.coord
        ):  # a replica that serves no decode rank: nothing to hold
            self._apply(transfer, Event.START)
            self._apply(transfer, Event.COMPLETE)
            return
        for peer, message, _ in self._early.pop(room, []):
            self._on_request_kv(peer, message)

    def _extend(self, room: str, pages: list[int]) -> None:
        transfer = self._transfers.get(room)
        if transfer is None:
            raise KeyError(f"room {room!r} is not live (never registered, or finished)")
        known = transfer.src_pages
        if len(known) + len(pages) > transfer.total_pages:
            raise ValueError(f"room {room!r}: {len(known)} + {len(pages)} pages exceed the "
                             f"{transfer.total_pages} its {transfer.num_tokens} tokens need")
        layout = self.pool.layout
        if pages and (min(pages) < 0 or max(pages) >= layout.num_pages
                      or len(set(pages) | set(known)) != len(known) + len(pages)):
            raise ValueError(f"room {room!r}: page ids must be distinct, in "
                             f"[0, {layout.num_pages})")
        known.extend(pages)

    def _add_part(  # noqa: PLR0917 - private; send_part's arguments, in order
        self,
        room: str,
        pages: range | None,
        layers: range | None,
        last: bool,
        ready: ReadyEvent | None,
        given: float,
        early: Mapping[str, _Gathered],
    ) -> None:
        self._disarm(room)  # a part was given: what the engine's thread did not take goes back
        try:
            transfer = self._transfers.get(room)
            if transfer is None:
                raise KeyError(f"room {room!r} is not live (never registered, or finished)")
            if transfer.last_given:
                raise ValueError(f"room {room!r}: a part was already sent with last=True")
            registered = len(transfer.src_pages)
            pages = pages if pages is not None else range(registered)
            if pages.step != 1 or not pages or pages.start < 0 or pages.stop > registered:
                raise ValueError(f"room {room!r}: pages {pages} not inside the request's "
                                 f"{registered} registered pages")
            stage = self._stage_layers
            span = LayerRange(layers.start, layers.stop) if layers is not None else stage
            if span.count <= 0 or span.start < stage.start or span.stop > stage.stop:
                raise ValueError(f"room {room!r}: layers {layers} not inside this stage's {stage}")
            try:
                transfer.coverage.claim(range(span.start, span.stop), pages)
            except CoverageError as exc:
                raise ValueError(f"room {room!r}: {exc}; each page of each layer is sent "
                                 "once") from exc
            transfer.specs.append(_PartSpec(pages, span, last, ready, given, early))
            transfer.last_given = last
            if last and not transfer.coverage.complete:
                # The engine ended the request without handing over all of its KV: decode would
                # read stale pages. The engine broke the API, not a peer: InternalError.
                detail = (f"the parts sent up to last=True leave {transfer.coverage.missing()} "
                          f"unsent; send every page of every layer of this stage "
                          f"{_span(stage)} before last=True")
                self._fail(transfer, FailureReason.INTERNAL_ERROR, detail)
                raise ValueError(f"room {room!r}: {detail}")
        except BaseException:
            for gathered in early.values():  # (already freed if the request ended)
                self.staging.free(gathered.region)
            raise

    # Messages ------------------------------------------------------------------------------

    def _on_message(self, peer: str, message: wire.Message) -> None:
        if isinstance(message, wire.RequestKV):
            self._on_request_kv(peer, message)
            return
        if isinstance(message, wire.StagedPart | wire.PartDone | wire.Finish | wire.AllocRequest
                      | wire.Withdrawn):
            self.reject("wrong_direction", f"{message.type} from {peer} to a prefill rank")
            return
        if isinstance(message, wire.RingUpdate):
            self._on_ring_update(peer, message)
            return
        if isinstance(message, wire.Watermark) and message.room is None:
            return  # an occupancy report; nothing waits on it here
        assert message.room is not None
        transfer = self._transfers.get(message.room)
        stream = transfer.streams.get(peer) if transfer is not None else None
        if transfer is None or stream is None:
            self.reject("unknown_room", f"{message.type} for {message.room!r} from {peer}")
            return
        with self.guard(self._failer(transfer)):
            if isinstance(message, wire.Grant | wire.GrantRefused):
                self._on_grant(transfer, stream, message)
            elif isinstance(message, wire.Watermark):
                out = stream.out.get(message.part if message.part is not None else -1)
                if out is not None and out.state is PartState.AWAITING_GRANT:
                    out.alloc_sent_at, out.retries = self.clock(), 0  # decode queued it
            elif isinstance(message, wire.Withdraw):
                if message.sender_id == stream.plan.sender_id:
                    self._on_withdraw(transfer, stream)
                else:
                    self.reject("sender_mismatch", f"Withdraw for sender {message.sender_id}")
            elif isinstance(message, wire.Release):
                stream.released = True
                stream.written.clear()
                self._check_complete(transfer)
            elif isinstance(message, wire.Abort):
                self._fail(transfer, FailureReason.ABORTED_BY_PEER,
                           f"decode {peer}: {message.reason}: {message.detail}", notify=False)

    def _on_request_kv(self, peer: str, message: wire.RequestKV) -> None:
        document = self.peers.get(peer)
        if document is None or document.role != "decode":
            self.reject("unknown_peer", f"RequestKV from {peer}, not a known decode rank")
            return
        if (document.pp_rank, document.tp_rank) != (message.decode_pp_rank,
                                                    message.decode_tp_rank):
            self.reject("coord_mismatch", f"{peer} is rank {document.coord}, claims otherwise")
            return
        transfer = self._transfers.get(message.room)
        if transfer is None:
            waiting = self._early.setdefault(message.room, [])
            if sum(len(v) for v in self._early.values()) >= MAX_EARLY_REQUESTS:
                self.reject("early_buffer_full", f"RequestKV for {message.room!r} from {peer}")
            elif all(p != peer for p, _, _ in waiting):
                waiting.append((peer, message, self.clock() + self.timeouts.kv_lease_s))
            if not waiting:
                del self._early[message.room]
            return
        if peer in transfer.streams:
            return  # a re-sent RequestKV: idempotent
        with self.guard(self._failer(transfer)):
            self._open_stream(transfer, peer, document, message)

    def _open_stream(
        self, transfer: SendTransfer, peer: str, document: RankDocument, message: wire.RequestKV
    ) -> None:
        plan = self._topology(document.parallelism).plan_between(
            self.identity.coord, document.coord
        )
        if plan is None:
            self.reject("not_a_writer", f"{peer} asked rank {self.identity.coord}, which "
                        f"sends it nothing")
            return
        layout = compute_layout(document)
        try:
            dst_pages = wire.expand_runs(message.dst_page_runs, document.num_pages)
        except Exception as exc:
            self._violation(transfer, peer, f"destination pages: {exc}")
            return
        problem = None
        first = message.first_page
        if (first + len(dst_pages) != transfer.total_pages
                or message.num_tokens != transfer.num_tokens
                or first * self.pool.layout.page_size >= transfer.num_tokens):
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
        elif transfer.instance not in (None, document.instance):
            problem = f"decode instance {document.instance} but {transfer.instance} asked first"
        if problem is not None:
            self._violation(transfer, peer, problem)
            return
        transfer.instance = document.instance
        if transfer.expected is None:
            plans = self._topology(document.parallelism).plans_from(self.identity.coord)
            transfer.expected = frozenset((p.decode.pp_rank, p.decode.tp_rank) for p in plans)
        pregrant = None
        if message.pregrant_offset is not None and message.pregrant_bytes is not None:
            pregrant = self._check_pregrant(transfer, peer, document, plan, len(dst_pages),
                                            message)
            if pregrant is None:
                return
        transfer.streams[peer] = _Stream(peer, document, layout, plan, message.path, dst_pages,
                                         first_page=first, pregrant=pregrant)
        if message.path == "staged":
            self._src_ids(transfer)  # now, not on the way of the first part
            self._arm(transfer, transfer.streams[peer])
        if transfer.lifecycle.state is State.BOOTSTRAPPING:
            transfer.transfer_deadline = self.clock() + self.timeouts.transfer_s
            self._apply(transfer, Event.START)

    def _check_pregrant(  # noqa: PLR0917 - private; _open_stream's checked values
        self, transfer: SendTransfer, peer: str, document: RankDocument, plan: TransferPlan,
        num_pages: int, message: wire.RequestKV,
    ) -> wire.Grant | None:
        """The RequestKV's pre-grant as part 0's Grant, if it is exactly the writer's whole
        share inside the peer's ring of its version; a violation fails the request (None).
        One of a ring version not in force here is no pre-grant: part 0 asks."""
        assert message.pregrant_offset is not None and message.pregrant_bytes is not None
        share = staged_chunk_bytes(self.pool.layout, plan.layers.count, num_pages,
                                   plan.heads.num_heads)
        ring = document.ring
        span = f"[{message.pregrant_offset}, +{message.pregrant_bytes})"
        if message.pregrant_bytes != share:
            self._violation(transfer, peer, f"pre-grant {span} for a share of {share} bytes")
            return None
        if ring is not None and message.ring_version == document.ring_version and (
                message.pregrant_offset + message.pregrant_bytes > ring.size_bytes):
            self.reject("region_mismatch", f"pre-grant {span} in a {ring.size_bytes}-byte ring")
            self._violation(transfer, peer, "pre-grant outside the ring")
            return None
        return wire.Grant(room=transfer.room, part=0, sender_id=plan.sender_id,
                          ring_offset=message.pregrant_offset,
                          size_bytes=message.pregrant_bytes, ring_version=message.ring_version)

    def _on_withdraw(self, transfer: SendTransfer, stream: _Stream) -> None:
        """Decode wants the pre-grant back (a resize, or a queued part needs the space): give
        it unless its WRITE is posted."""
        out = stream.out.get(0)
        if stream.pregrant is not None:
            stream.pregrant = None
            self._disarm(transfer.room, stream.peer)  # gathered early or not, part 0 asks
        elif out is not None and out.pregranted and out.state is PartState.AWAITING_GRANT:
            out.grant, out.pregranted = None, False
            out.stamps.pop(Stamp.GRANTED, None)
            out.alloc_sent_at = self.clock()
            self.alloc_requests_sent += 1
        else:
            return  # posted (its StagedPart is on its way) or given back already
        self.send(stream.peer, wire.Withdrawn(room=transfer.room,
                                              sender_id=stream.plan.sender_id))
        if out is not None and out.state is PartState.AWAITING_GRANT and out.grant is None:
            self.send(stream.peer, self._alloc_request(transfer, stream, out))

    def _on_grant(self, transfer: SendTransfer, stream: _Stream,
                  msg: wire.Grant | wire.GrantRefused) -> None:
        out = stream.out.get(msg.part)
        if msg.sender_id != stream.plan.sender_id or out is None:
            self.reject("unexpected_grant", f"{msg.type} for part {msg.part} of "
                        f"{transfer.room!r}, sender {msg.sender_id}: never requested")
            return
        if out.state is not PartState.AWAITING_GRANT:
            if out.grant != msg:
                self.reject("unexpected_grant",
                            f"{msg.type} for part {msg.part} in {out.state.value}")
            return  # a duplicate of the grant in use
        if isinstance(msg, wire.GrantRefused):
            needed_mib = -(-msg.needed_bytes // (1 << 20))
            self._fail(transfer, FailureReason.OVERSIZED_CHUNK,
                       f"a part needs {msg.needed_bytes} staging bytes but decode's pool holds "
                       f"{msg.capacity_bytes}; raise decodePoolMiB to at least {needed_mib} "
                       f"MiB or send smaller chunks")
            return
        known = self._peer_document(stream)
        if msg.ring_version < known.ring_version:  # a grant of a ring since re-registered
            self.reject("stale_registration", f"grant for ring version {msg.ring_version}; "
                        f"{stream.peer}'s ring in force is version {known.ring_version}")
            return
        if msg.size_bytes != out.size_bytes:
            self.reject("region_mismatch", f"grant of {msg.size_bytes} bytes for a "
                        f"{out.size_bytes}-byte part")
            self._violation(transfer, stream.peer, "grant of the wrong size")
            return
        out.grant = msg  # a newer version than known waits for its RingUpdate
        out.stamps[Stamp.GRANTED] = self.clock()
        self._try_post_staged(transfer, stream, out)

    # Progress ------------------------------------------------------------------------------

    def _moving(self) -> bool:
        """The engine gave parts of a Transferring request: grants, gathers, WRITEs and the
        Release are due."""
        return any(t.specs and t.lifecycle.state is State.TRANSFERRING
                   for t in self._transfers.values())

    def _progress(self) -> bool:
        busy = False
        for transfer in list(self._transfers.values()):
            if transfer.lifecycle.state is not State.TRANSFERRING:
                continue
            with self.guard(self._failer(transfer)):
                for stream in list(transfer.streams.values()):
                    busy = self._advance(transfer, stream) or busy
                    if transfer.lifecycle.finished:
                        break
                if not transfer.lifecycle.finished:
                    self._check_complete(transfer)
        self._enqueue_gathers()
        if self._resize is not None:
            self._disarm()  # no gather into the buffer being drained
            busy = self._step_resize() or busy
        return busy

    def _advance(self, transfer: SendTransfer, stream: _Stream) -> bool:
        busy = self._make_parts(transfer, stream)
        for out in list(stream.out.values()):
            if transfer.lifecycle.finished:
                return True
            if out.state is PartState.WAITING_READY:
                if out.spec.ready is not None and not out.spec.ready.query():
                    continue
                busy = True
                out.stamps[Stamp.READY] = self.clock()
                if stream.path == "staged":
                    self.part_machine.apply(out, PartEvent.READY)
                else:
                    self._post_direct(transfer, stream, out)
            if out.state is PartState.WAITING_STAGING and out.region is None:
                busy = self._stage_part(transfer, stream, out) or busy
            elif out.state is PartState.AWAITING_GRANT and out.grant is not None:
                busy = self._try_post_staged(transfer, stream, out) or busy
            elif out.state is PartState.AWAITING_GRANT:
                self._gathered(out)  # stamps the gather's end while the grant is awaited
            elif out.state is PartState.WRITING and out.handle is not None:
                busy = self._poll_write(transfer, stream, out) or busy
        return busy

    def _make_parts(self, transfer: SendTransfer, stream: _Stream) -> bool:
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
                    final=final, stamps={Stamp.GIVEN: spec.given_at, Stamp.PICKED: self.clock()})
                if index == 0 and (gathered := spec.early.get(stream.peer)) is not None:
                    self._take_gathered(transfer, stream, out, gathered)
                made = True
            if spec.last and not stream.final_sent:
                stream.final_sent = True
                if start >= stop or not pages:
                    if stream.parts_made == 0:
                        raise ValueError(f"no part of {transfer.room!r} had layers for decode "
                                         f"rank {stream.plan.decode}")
                    self.send(stream.peer, wire.Finish(room=transfer.room,
                                                       sender_id=stream.plan.sender_id,
                                                       final_parts=stream.parts_made))
        return made

    def _post_direct(self, transfer: SendTransfer, stream: _Stream, out: _OutPart) -> None:
        """Contiguous or sliced: one WRITE straight into decode's pages, PartDone attached."""
        layers, pages = self._pairs(transfer, stream, out)
        src_bases = self.pool.base_table()
        dst_bases = stream.document.layer_bases
        if stream.path == "contiguous":
            local, remote = compute_contiguous_spans(
                self.pool.layout, src_bases=src_bases, dst=stream.layout, dst_bases=dst_bases,
                layers=layers, pages=pages)
        else:
            local, remote = compute_sliced_spans(
                self.pool.layout, src_bases=src_bases, dst=stream.layout, dst_bases=dst_bases,
                layers=layers, pages=pages, plan=stream.plan)
        note = wire.PartDone(room=transfer.room, part=out.index,
                             sender_id=stream.plan.sender_id, layer_start=out.layers.start,
                             layer_stop=out.layers.stop,
                             page_start=out.pages.start - stream.first_page,
                             page_count=len(out.pages), final_parts=out.final)
        regions = [r.to_region() for r in stream.document.kv_regions]
        out.size_bytes = sum(length for _, length in local)
        sealed = self.seal(stream.peer, note)
        self._post(transfer, stream, out,
                   lambda: self.transport.write(stream.peer, local, remote, regions, sealed),
                   len(local), sealed)

    def _stage_part(self, transfer: SendTransfer, stream: _Stream, out: _OutPart) -> bool:
        if self._resize is not None:
            return False  # no new gather while the staging buffer is being re-sized
        stage = self._stage_layers.start
        layers = range(out.layers.start - stage, out.layers.stop - stage)  # local layers
        heads = stream.plan.heads
        size = staged_chunk_bytes(self.pool.layout, len(layers), len(out.pages),
                                  heads.num_heads)
        try:
            region = self.staging.allocate(transfer.room, size)
        except OversizedAllocation:
            self._fail(transfer, FailureReason.OVERSIZED_CHUNK,
                       f"a part needs {size} staging bytes but the prefill buffer holds "
                       f"{self.staging.capacity_bytes}; raise prefillBufferMiB to at least "
                       f"{-(-size // (1 << 20))} MiB or send smaller chunks")
            return True
        if region is None:
            return False  # the buffer is full: a finishing WRITE frees it
        out.region, out.size_bytes = region, size
        # The AllocRequest (if no pre-grant serves) goes now, the gather at the end of this
        # step (``_enqueue_gathers``): decode's turn-around overlaps the gathers' enqueue,
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
        self.part_machine.apply(out, PartEvent.READY)
        self.part_machine.apply(out, PartEvent.GATHER)
        if not self._use_pregrant(stream, out):
            self._ask_grant(transfer, stream, out)

    def _use_pregrant(self, stream: _Stream, out: _OutPart) -> bool:
        """Part 0 takes its stream's pre-grant (its first ``size_bytes``) if it fits and its
        ring is in force; otherwise it asks, and its AllocRequest gives the pre-grant back."""
        if out.index != 0 or stream.pregrant is None:
            return False
        pregrant, stream.pregrant = stream.pregrant, None
        if out.size_bytes > pregrant.size_bytes or (
                pregrant.ring_version != self._peer_document(stream).ring_version):
            return False  # its ring was re-registered since
        out.grant = (pregrant if pregrant.size_bytes == out.size_bytes  # the whole share
                     else pregrant.model_copy(update={"size_bytes": out.size_bytes}))
        out.pregranted = True
        self.pregrants_taken += 1
        out.stamps[Stamp.PREGRANT_TAKEN] = out.stamps[Stamp.GRANTED] = self.clock()
        return True

    def _ask_grant(self, transfer: SendTransfer, stream: _Stream, out: _OutPart) -> bool:
        """Send ``out``'s AllocRequest; False if the peer is gone (its requests failed)."""
        out.alloc_sent_at = self.clock()
        self.alloc_requests_sent += 1
        if not self.send(stream.peer, self._alloc_request(transfer, stream, out)):
            return False
        out.stamps[Stamp.ALLOC_SENT] = self.clock()
        return True

    def _enqueue_gathers(self) -> None:
        """Enqueue the gathers whose AllocRequests this step sent (see ``_stage_part``)."""
        gathers, self._gathers = self._gathers, []
        for transfer, stream, out, layers in gathers:
            if transfer.lifecycle.finished:
                continue  # failed meanwhile: its staging space is freed
            with self.guard(self._failer(transfer)):
                region = out.region
                assert region is not None
                out.stamps[Stamp.GATHER_QUEUED] = self.clock()
                view = self.staging_buffer[region.offset_bytes
                                           : region.offset_bytes + out.size_bytes]
                pages = self._src_ids(transfer).select(out.pages.start, out.pages.stop)
                heads = stream.plan.heads
                if self._stream is not None:
                    # Its ready event has fired (``_advance``; on CUDA every part has one):
                    # its KV is written, and its page ids were uploaded on this stream
                    # (``thread_started``). Ordering it after the default stream's tail
                    # would make it wait for work queued since (later layers; failure #35).
                    gather(self.pool, layers, pages, head_start=heads.src_head_offset,
                           num_heads=heads.num_heads, out=view, stream=self._stream.stream)
                    out.gathered = self._stream.record()
                else:
                    gather(self.pool, layers, pages, head_start=heads.src_head_offset,
                           num_heads=heads.num_heads, out=view)
                out.stamps[Stamp.GATHER_ENQUEUED] = self.clock()
                self.part_machine.apply(out, PartEvent.GATHER)
                self.metrics.gathers_launched("worker", 1)

    def _src_ids(self, transfer: SendTransfer) -> PageIds:
        """The request's source pages on the pool's device, made once (again only when
        ``extend_request`` added pages since)."""
        ids = transfer.src_ids
        if ids is None or len(ids) != len(transfer.src_pages):
            ids = transfer.src_ids = prepare_pages(self.pool, transfer.src_pages)
        return ids

    def _alloc_request(
        self, transfer: SendTransfer, stream: _Stream, out: _OutPart
    ) -> wire.AllocRequest:
        return wire.AllocRequest(room=transfer.room, part=out.index,
                                 sender_id=stream.plan.sender_id, size_bytes=out.size_bytes)

    def _try_post_staged(self, transfer: SendTransfer, stream: _Stream, out: _OutPart) -> bool:
        grant, staging = out.grant, out.region
        if grant is None or staging is None or not self._gathered(out):
            return False
        document = self._peer_document(stream)
        ring = document.ring
        assert ring is not None  # checked when the stream opened
        if grant.ring_version != document.ring_version:
            return False  # granted in a ring whose RingUpdate has not arrived yet
        if grant.ring_offset + grant.size_bytes > ring.size_bytes:
            self.reject("region_mismatch", f"grant [{grant.ring_offset}, +{grant.size_bytes})"
                        f" in a {ring.size_bytes}-byte ring")
            self._violation(transfer, stream.peer, "grant outside the ring")
            return True
        held = self._writes.pop((transfer.room, stream.peer), None) if out.index == 0 else None
        if held is not None and held.region is staging and held.grant == grant:
            write = held.write  # the same bytes into the same region, the same StagedPart
            self.prepared_writes_posted += 1
            self._post(transfer, stream, out, lambda: self.transport.post(write), 1, held.note)
            return True
        if held is not None:
            self.transport.discard(held.write)
        note, local, remote, regions = self._staged_write(
            transfer, stream, out.index, out.layers, out.pages, out.final, grant,
            staging.offset_bytes, out.size_bytes)
        self._post(transfer, stream, out,
                   lambda: self.transport.write(stream.peer, local, remote, regions, note),
                   len(local), note)
        return True

    def _staged_write(  # noqa: PLR0917 - private; a part's fields, as both callers hold them
        self, transfer: SendTransfer, stream: _Stream, index: int, layers: LayerRange,
        pages: range, final: int | None, grant: wire.Grant, staging_offset: int, size: int,
    ) -> tuple[bytes, list[Span], list[Span], list[RegisteredRegion]]:
        """A staged part's WRITE: its sealed StagedPart and its one descriptor pair (from
        ``size`` staging bytes at ``staging_offset`` into the granted ring region)."""
        ring = self._peer_document(stream).ring
        assert ring is not None  # checked when the stream opened
        note = wire.StagedPart(
            room=transfer.room, part=index, sender_id=stream.plan.sender_id,
            ring_offset=grant.ring_offset, size_bytes=grant.size_bytes,
            layer_start=layers.start, layer_stop=layers.stop,
            page_start=pages.start - stream.first_page, page_count=len(pages),
            ring_version=grant.ring_version, final_parts=final,
        )
        granted = RegisteredRegion(f"{ring.name}@{grant.ring_offset}",
                                   ring.base_address + grant.ring_offset, grant.size_bytes,
                                   ring.to_region().kind, ring.device_id)
        local = [(self.staging_region.base_address + staging_offset, size)]
        remote = [(granted.base_address, grant.size_bytes)]
        return self.seal(stream.peer, note), local, remote, [granted]

    def _post(  # noqa: PLR0917 - private; the part, its transport call and what it carries
        self, transfer: SendTransfer, stream: _Stream, out: _OutPart,
        post: Callable[[], TransferHandle], descriptors: int, note: bytes,
    ) -> None:
        """Post ``out``'s WRITE (``post``: the transport call, its notification the sealed
        ``note``, kept for ``_renotify``) and account for it."""
        out.note = note
        try:
            out.handle = post()
        except PeerUnreachable as exc:
            self.prune_peer(stream.peer, str(exc))
            return
        except DescriptorError as exc:
            self._violation(transfer, stream.peer, f"descriptors refused: {exc}")
            return
        except TransportError as exc:
            self._fail(transfer, FailureReason.TRANSPORT_FAILED, str(exc))
            return
        self.part_machine.apply(out, PartEvent.POST)
        out.stamps[Stamp.POSTED] = self.clock()
        self.metrics.write_posted(stream.path, descriptors)

    def _poll_write(self, transfer: SendTransfer, stream: _Stream, out: _OutPart) -> bool:
        assert out.handle is not None
        state = self.transport.state(out.handle)
        if state is TransferState.PENDING:
            return False
        self.transport.release(out.handle)
        out.handle = None
        if state is TransferState.FAILED:
            # Tell a live peer from a dead one: messaging a dead peer raises at once and
            # prunes it (→ PeerUnreachable for all its requests).
            if self.send(stream.peer, wire.Abort(room=transfer.room, reason="TransportFailed")):
                self._fail(transfer, FailureReason.TRANSPORT_FAILED,
                           f"a WRITE to {stream.peer} failed", notify=False)
            return True
        if out.region is not None:
            self.staging.free(out.region)
        transfer.bytes += out.size_bytes
        if out.note is not None:
            stream.written[out.index], stream.written_at = out.note, self.clock()
        self.metrics.bytes_moved(stream.path, out.size_bytes)
        self.part_machine.apply(out, PartEvent.DONE)
        out.stamps[Stamp.WRITTEN] = self.clock()
        self._part_finished(transfer, stream.peer, stream.plan.sender_id, out.index,
                            stream.path, out.size_bytes, out.stamps)
        del stream.out[out.index]
        return True

    def _gathered(self, out: _OutPart) -> bool:
        """Whether the part's gather has finished (CUDA: its event fired); stamps it once."""
        if Stamp.GATHERED in out.stamps:
            return True
        if out.gathered is not None and not out.gathered.query():  # type: ignore[no-untyped-call]
            return False
        out.stamps[Stamp.GATHERED] = self.clock()
        return True

    def _pairs(
        self, transfer: SendTransfer, stream: _Stream, out: _OutPart
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        plan = stream.plan
        layers = [(g - self._stage_layers.start, g - plan.layers.start + plan.dst_layer_start)
                  for g in range(out.layers.start, out.layers.stop)]
        first = stream.first_page
        pages = [(transfer.src_pages[i], stream.dst_pages[i - first]) for i in out.pages]
        return layers, pages

    # Deadlines and endings -----------------------------------------------------------------

    def _check_deadlines(self, now: float) -> None:
        for room, waiting in list(self._early.items()):
            for entry in [e for e in waiting if e[2] <= now]:
                waiting.remove(entry)
                self.reject("expired_early_request", f"RequestKV for unregistered {room!r}")
                self.send(entry[0], wire.Abort(room=room,
                                               reason=FailureReason.LEASE_EXPIRED.value,
                                               detail="prefill never registered this room"))
            if not waiting:
                del self._early[room]
        for transfer in list(self._transfers.values()):
            with self.guard(self._failer(transfer)):
                self._check_transfer_deadlines(transfer, now)

    def _check_transfer_deadlines(self, transfer: SendTransfer, now: float) -> None:
        state = transfer.lifecycle.state
        if state is State.BOOTSTRAPPING and now >= transfer.lease_deadline:
            self._fail(transfer, FailureReason.LEASE_EXPIRED,
                       f"no decode rank asked for this KV within {self.timeouts.kv_lease_s} s")
            return
        if state is not State.TRANSFERRING:
            return
        if now >= transfer.transfer_deadline:
            self._fail(transfer, FailureReason.TRANSFER_TIMEOUT,
                       f"not finished within {self.timeouts.transfer_s} s")
            return
        for stream in transfer.streams.values():
            known = self._peer_document(stream).ring_version
            for out in stream.out.values():
                if out.state is not PartState.AWAITING_GRANT:
                    continue
                # A grant in a ring whose RingUpdate has not arrived is no grant yet: the
                # update may be lost, and a re-sent AllocRequest makes decode send it again.
                if out.grant is not None and out.grant.ring_version <= known:
                    continue
                if now - out.alloc_sent_at < self.timeouts.grant_s:
                    continue
                out.retries += 1
                if out.retries > self.timeouts.grant_retries:
                    missing = ("no grant" if out.grant is None else
                               f"a grant in ring version {out.grant.ring_version} but no "
                               f"RingUpdate for it (version {known} in force)")
                    self._fail(transfer, FailureReason.GRANT_TIMEOUT,
                               f"{missing} from {stream.peer} for part {out.index} after "
                               f"{self.timeouts.grant_retries} re-sends")
                    return
                out.alloc_sent_at = now
                self.send(stream.peer, self._alloc_request(transfer, stream, out))
            self._renotify(transfer, stream, now)

    def _renotify(self, transfer: SendTransfer, stream: _Stream, now: float) -> None:
        """Send the notifications of ``stream``'s written parts again, as messages, when
        every part is written and decode's Release has not come within a quarter of the
        stall watchdog's time (at least ``grant_s``): a WRITE's data can land while its
        notification is lost (NIXL's UCX backend drops one in a known case), and decode
        would wait for it until its watchdog failed the request. Decode counts a copy of a
        notification it had as a duplicate and acts on a missing one; a slow decode's
        Release (a scatter still running) usually comes first. At most ``grant_retries``
        rounds."""
        wait_s = max(self.timeouts.grant_s, self.timeouts.stall_s / 4)
        if (stream.released or not stream.written or stream.out or not transfer.last_given
                or stream.next_spec < len(transfer.specs) or now - stream.written_at < wait_s
                or stream.renotified >= self.timeouts.grant_retries):
            return
        stream.renotified += 1
        stream.written_at = now
        _log.info("room %s: no Release from %s %.1f s after its last WRITE; sending the "
                  "notifications of parts %s again (round %d)", transfer.room, stream.peer,
                  wait_s, sorted(stream.written), stream.renotified)
        self.metrics.notifications_resent(len(stream.written))
        for note in list(stream.written.values()):
            if not self.send_sealed(stream.peer, note):
                return

    def _check_complete(self, transfer: SendTransfer) -> None:
        if transfer.lifecycle.state is not State.TRANSFERRING or transfer.expected is None:
            return
        if not transfer.last_given or len(transfer.streams) < len(transfer.expected):
            return
        if not transfer.coverage.complete:
            return  # unreachable: a last part that leaves cells unsent fails the request
        for stream in transfer.streams.values():
            if stream.next_spec < len(transfer.specs) or stream.out or not stream.released:
                return
        self._apply(transfer, Event.COMPLETE)

    def _release(self, transfer: SendTransfer) -> None:
        """Terminal: abort WRITEs in flight, free staging, forget the request. Runs once."""
        self._transfers.pop(transfer.room, None)
        if transfer.lifecycle.state is State.FAILED:
            self._log_unwritten(transfer)
        for stream in transfer.streams.values():
            part0 = stream.out.get(0)
            unwritten = stream.pregrant is not None or (
                part0 is not None and part0.pregranted and part0.state is PartState.AWAITING_GRANT)
            if unwritten and stream.peer in self.peers:  # decode may free it before its grace
                self.send(stream.peer, wire.Withdrawn(room=transfer.room,
                                                      sender_id=stream.plan.sender_id))
            for out in stream.out.values():
                if out.handle is not None:
                    try:
                        self.transport.release(out.handle)
                    except TransportError as exc:
                        _log.warning("room %s: releasing a WRITE: %s", transfer.room, exc)
            stream.out.clear()
            self._discard_write(transfer.room, stream.peer)
        # Under the lock the engine's thread holds from taking a room's gathers to their
        # launch: space it gathers into is freed after that launch, so a gather of the next
        # owner is queued behind it on the staging stream, never before it.
        with self._armed_lock:
            self._armed.pop(transfer.room, None)
            self.staging.free_owner(transfer.room)

    def _log_unwritten(self, transfer: SendTransfer) -> None:
        """Where each part a failed request left unwritten stopped: the line a decode rank's
        failure of the same room (a StalledWriter, say) is read against."""
        now = self.clock()
        left = [f"to {stream.peer}: part {out.index} {self._where(out, now)}"
                for stream in transfer.streams.values() for out in stream.out.values()]
        if left:
            reason = transfer.lifecycle.reason
            _log.warning("room %s failed (%s) with parts unwritten: %s", transfer.room,
                         reason.value if reason is not None else "no reason", "; ".join(left))

    def _where(self, out: _OutPart, now: float) -> str:
        """``out``'s state, with how long ago it was given and what it waits for."""
        where = [out.state.value, _ago("given", out.stamps.get(Stamp.GIVEN), now)]
        if out.state is PartState.AWAITING_GRANT:
            if out.grant is None:
                where.append("no grant")
            else:
                where.append(f"{'pre-' if out.pregranted else ''}granted {out.grant.size_bytes}"
                             f" bytes at {out.grant.ring_offset} of ring version "
                             f"{out.grant.ring_version}")
            where.append("gathered" if Stamp.GATHERED in out.stamps else "gather pending")
        elif out.state is PartState.WRITING and out.handle is not None:
            try:
                write = self.transport.state(out.handle).value
            except TransportError as exc:
                write = f"unknown ({exc})"
            where.append(f"{_ago('posted', out.stamps.get(Stamp.POSTED), now)}, the WRITE {write}")
        return ", ".join(where)

    def _on_peer_lost(self, peer: str, detail: str) -> None:
        for transfer in list(self._transfers.values()):
            if peer in transfer.streams:
                self._fail(transfer, FailureReason.PEER_UNREACHABLE, detail, notify=False)

    # Decode ring updates and own-buffer resizes ------------------------------------------------

    def _peer_document(self, stream: _Stream) -> RankDocument:
        """The peer's document in force (its ring may have been re-registered since the
        stream opened)."""
        return self.peers.get(stream.peer, stream.document)

    def _on_ring_update(self, peer: str, message: wire.RingUpdate) -> None:
        document = self.peers.get(peer)
        if document is None or document.role != "decode":
            self.reject("unknown_peer", f"RingUpdate from {peer}, not a known decode rank")
            return
        if message.ring_version <= document.ring_version:
            if message.ring_version < document.ring_version:
                self.reject("stale_registration", f"RingUpdate {message.ring_version} from "
                            f"{peer}; version {document.ring_version} is in force")
            return
        # The message's MAC (checked at intake) proves ``peer`` sent it; the transport
        # loads the metadata only if it embeds that same name (docs/failure-modes.md #26).
        try:
            ring = RegionDoc(name=message.name, base_address=message.base_address,
                             size_bytes=message.size_bytes, kind=message.kind,
                             device_id=message.device_id)
            metadata = base64.b64decode(message.transport_metadata_b64, validate=True)
            self.transport.add_peer(metadata, expected_name=peer)  # its registrations changed
        except (ValueError, TransportError) as exc:  # pydantic's ValidationError included
            self.reject("invalid_ring_update", f"from {peer}: {exc}")
            return
        self.peers[peer] = document.model_copy(update={
            "ring": ring, "ring_version": message.ring_version,
            "transport_metadata_b64": message.transport_metadata_b64})
        _log.info("decode %s re-registered its ring: %d bytes, version %d", peer,
                  message.size_bytes, message.ring_version)

    def _staging_pool(self) -> StagingRing:
        return self.staging

    def _staging_version(self) -> int:
        return self.staging_version

    def _holds_staging(self, transfer: SendTransfer) -> bool:
        return bool(self.staging.regions_of(transfer.room))

    def _swap_staging(self, new_bytes: int) -> None:
        # Uninitialised: every region is written before it is read, and a zero-fill would
        # be a kernel that a peer's WRITE into the new buffer does not wait for.
        if self._stream is not None:
            # A gather of a request failed at the deadline may still be queued: the old
            # buffer's memory must not go back to the allocator under it.
            self._stream.stream.synchronize()
        new_buffer = torch.empty(new_bytes, dtype=torch.uint8, device=self.pool.device)
        old_buffer, old_region = self.staging_buffer, self.staging_region
        self.transport.deregister(old_region)
        try:
            region = self.transport.register(
                new_buffer, name=f"{self.transport.agent_name}/staging-v{self.staging_version + 1}")
        except Exception:
            self.staging_region = self.transport.register(old_buffer, name=old_region.name)
            raise
        self.staging_buffer, self.staging_region = new_buffer, region
        self.staging = StagingRing(new_bytes)
        self.staging_version += 1

    def _topology(self, decode: Parallelism) -> TransferTopology:
        return compute_transfer_topology(self.identity.geometry.kv_geometry(),
                                         self.identity.parallelism, decode)


def _span(layers: LayerRange) -> str:
    return f"[{layers.start}, {layers.stop})"


def _ago(step: str, at: float | None, now: float) -> str:
    return step if at is None else f"{step} {now - at:.1f} s ago"
