"""``PrefillSender``: a prefill rank's endpoint; its engine API, commands and message dispatch.

The sender checks what the engine gives and routes what decode sends; the work is done by
the collaborators it owns, each given the endpoint's services as one ``SenderContext``:
``StreamOpener`` (decode's RequestKV, streams.py), ``PartMaker`` (parts, staging, grants,
parts.py), ``EngineGathers`` (gathers on the engine's thread, gathers.py), ``Poster``
(WRITEs, posting.py) and ``Endings`` (deadlines and release, endings.py). Per step
(``Endpoint.step``): commands, then messages (``_on_message``), then ``_progress`` (each
Transferring request's streams advance part by part, then the step's gathers are enqueued),
then ``_check_deadlines``.

Decode ring resizes: a ``RingUpdate`` from a decode peer replaces that peer's ring region,
registration version and transport metadata (kept per peer, so decode peers with different
pool sizes are served at once), once checked (``_ring_problem``; docs/failure-modes.md #26):
its version is newer than the one in force by at most ``MAX_RING_VERSION_STEP`` (the same
version again is a repeat if it announces the same ring, else refused), the ring keeps its
memory kind and device, lies outside every KV region the peer's document published and
outside the ring in force, and the new metadata registers exactly that buffer. A grant of an
older version than the peer's ring in force is refused; one of a newer version waits for its
RingUpdate: nothing is ever written with an older registration. ``Endpoint.resize`` (the
``AgentStaging``'s prefill buffer size) re-sizes this rank's own staging buffer: no new
gather starts, parts holding staging space finish until the deadline (the rest fail
ResizeDeadline), the buffer is re-registered (``StagingBuffer.swap``), gathers resume.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

from pd_transfer.common.metrics import TransferMetrics
from pd_transfer.common.phases import PhaseLog, Stamp
from pd_transfer.endpoint import (
    Endpoint,
    PollIntervals,
    RankIdentity,
    StagingSide,
    Timeouts,
)
from pd_transfer.errors import TransportError
from pd_transfer.kv.plan import LayerRange, compute_stage_layers
from pd_transfer.kv.pool import KVPool
from pd_transfer.kv.ring import StagingRing
from pd_transfer.prefill.buffer import StagingBuffer
from pd_transfer.prefill.context import SenderContext
from pd_transfer.prefill.endings import Endings
from pd_transfer.prefill.gathers import EngineGathers
from pd_transfer.prefill.parts import PartMaker
from pd_transfer.prefill.posting import Poster
from pd_transfer.prefill.streams import StreamOpener
from pd_transfer.prefill.transfer import (
    DecodeBinding,
    ReadyEvent,
    SendTransfer,
    _Gathered,
    _PartSpec,
    _Stream,
)
from pd_transfer.protocol import messages as wire
from pd_transfer.protocol.coverage import CoverageError
from pd_transfer.protocol.lifecycle import Event, FailureReason, Role, State
from pd_transfer.protocol.parts import PartEvent, PartState
from pd_transfer.transport.base import RegisteredRegion, Transport
from pd_transfer.trust.auth import PeerAuth
from pd_transfer.trust.bootstrap import RankDocument, RegionDoc

__all__ = ["MAX_RING_VERSION_STEP", "PrefillSender"]

_log = logging.getLogger("pd_transfer")
MAX_RING_VERSION_STEP = 64
"""How far a RingUpdate may skip ahead of the version in force (a decode rank re-registers
once per resize, and tells every prefill peer each time)."""


class PrefillSender(Endpoint[SendTransfer]):
    """One prefill rank's sending endpoint (see the package docstring)."""

    role = Role.PREFILL

    def __init__(self, transport: Transport, pool: KVPool, identity: RankIdentity, *,
                 auth: PeerAuth, staging_bytes: int, timeouts: Timeouts | None = None,
                 metrics: TransferMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 phases: PhaseLog | None = None, poll: PollIntervals | None = None,
                 engine_thread_gathers: bool | None = None) -> None:
        """``engine_thread_gathers``: whether ``send_part`` launches the gathers set aside
        for it (gathers.py); default: on CUDA, where the engine's thread launches kernels
        back to back and the worker's first launch after a wait costs several times more.
        On CPU the gather would run on the engine's thread, so tests only."""
        staging = StagingSide[SendTransfer](
            "buffer", allocator=lambda: self._buffer.ring, version=lambda: self._buffer.version,
            holds=lambda transfer: bool(self._buffer.ring.regions_of(transfer.room)),
            swap=lambda new_bytes: self._buffer.swap(new_bytes))  # noqa: PLW0108 - late bound
        super().__init__(transport, pool, identity, auth=auth, staging=staging,
                         timeouts=timeouts, metrics=metrics, clock=clock, phases=phases,
                         poll=poll)
        self._buffer = StagingBuffer(transport, pool.device, staging_bytes, self._stream)
        self.metrics.set_staging(staging_bytes, self._buffer.version)
        self._stage_layers = compute_stage_layers(
            identity.geometry.num_layers, identity.parallelism.pp, identity.coord.pp_rank
        )
        self.alloc_requests_sent = 0  # first sends only (docs/failure-modes.md #1 counts these)
        self.pregrants_taken = 0  # parts 0 written into their RequestKV's pre-grant instead
        self.prepared_writes_posted = 0  # parts 0 posted with the WRITE prepared at arming
        ctx = SenderContext(
            identity=identity, transport=transport, pool=pool, metrics=self.metrics,
            timeouts=self.timeouts, clock=self.clock, part_machine=self.part_machine,
            peers=self.peers, stream=self._stream, stage=self._stage_layers,
            buffer=self._buffer, counts=self, resizing=lambda: self.resizing,
            send=self.send, send_sealed=self.send_sealed, seal=self.seal, reject=self.reject,
            prune_peer=self.prune_peer, guard=lambda t: self.guard(self._failer(t)),
            fail=self._fail, violation=self._violation, apply=self._apply,
            part_finished=self._part_finished)
        self._ctx = ctx
        self._poster = Poster(ctx)
        self._engine_gathers = EngineGathers(ctx, self._poster, enabled=(
            pool.device.type == "cuda" if engine_thread_gathers is None
            else engine_thread_gathers))
        self._parts = PartMaker(ctx, self._engine_gathers, self._poster)
        self._streams = StreamOpener(ctx, self._transfers, self._engine_gathers)
        self._endings = Endings(ctx, self._engine_gathers, self._poster)

    # The staging buffer in force ----------------------------------------------------------

    @property
    def staging(self) -> StagingRing:
        """The allocator of the staging buffer in force."""
        return self._buffer.ring

    @property
    def staging_region(self) -> RegisteredRegion:
        """The staging buffer's registration in force."""
        return self._buffer.region

    @property
    def staging_version(self) -> int:
        """The staging buffer's registration version (1, then one more per resize)."""
        return self._buffer.version

    # Engine API ----------------------------------------------------------------------------

    def register_request(
        self, room: str, page_ids: Sequence[int], num_tokens: int, *,
        decode_instance: str | DecodeBinding = DecodeBinding.FIRST_TO_ASK,
    ) -> Future[None]:
        """Hold ``page_ids`` (the request's KV, in request order) for decode to claim. With
        chunked prefill the pages may be the first ones only; ``extend_request`` appends
        the rest as the engine allocates them, before the parts that send them.

        ``decode_instance``: the decode engine instance the request was given to (the one
        at the bootstrap address the router gave); only its ranks' RequestKVs are taken
        (docs/failure-modes.md #60). ``DecodeBinding.LATER``: ``bind_request`` will name it
        (RequestKVs wait till then); ``FIRST_TO_ASK``: the first instance to ask."""
        pages = [int(p) for p in page_ids]
        return self.submit(lambda: self._register(room, pages, num_tokens, decode_instance))

    def bind_request(self, room: str, decode_instance: str) -> Future[None]:
        """Name the decode instance of a request registered with ``DecodeBinding.LATER``."""
        return self.submit(lambda: self._streams.bind(room, decode_instance))

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
        early = (self._engine_gathers.launch(room, pages, layers, ready_event)
                 if last and self._engine_gathers.any_armed else {})
        return self.submit(lambda: self._add_part(room, pages, layers, last, ready_event,
                                                  given, early))

    def debug_counts(self) -> dict[str, int]:
        """Sizes of every per-request structure (docs/failure-modes.md #11 tests compare to
        baseline)."""
        armed = self._engine_gathers.armed_count()
        return {
            "transfers": len(self._transfers),
            "early_requests": self._streams.early_count(),
            "staging_regions": self.staging.live_regions,
            "armed_gathers": armed,
            "prepared_writes": self._poster.prepared_count(),
            **self.status_counts(),
        }

    # Commands (worker thread) -------------------------------------------------------------

    def _register(self, room: str, pages: list[int], num_tokens: int,
                  decode_instance: str | DecodeBinding) -> None:
        page_size = self.pool.layout.page_size
        if num_tokens > 0 and len(pages) * page_size < num_tokens:  # the first chunk's pages
            self._check_new(room, pages, len(pages) * page_size, "registered")
        else:
            self._check_new(room, pages, num_tokens, "registered")
        transfer = SendTransfer(room, pages, num_tokens, created=self.clock(),
                                page_size=page_size, stage=self._stage_layers,
                                kv_lease_s=self.timeouts.kv_lease_s, release=self._release)
        if isinstance(decode_instance, str):
            transfer.instance = decode_instance
        else:
            transfer.awaiting_binding = decode_instance is DecodeBinding.LATER
        self._admit(transfer)
        decode_pars = {d.parallelism for d in self.peers.values() if d.role == "decode"}
        if len(decode_pars) == 1 and not self._ctx.topology(decode_pars.pop()).plans_from(
            self.identity.coord
        ):  # a replica that serves no decode rank: nothing to hold
            self._apply(transfer, Event.START)
            self._apply(transfer, Event.COMPLETE)
            return
        self._streams.take_early(room)

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
        # A part was given: what the engine's thread did not take goes back.
        self._engine_gathers.disarm(room)
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
                          f"[{stage.start}, {stage.stop}) before last=True")
                self._fail(transfer, FailureReason.INTERNAL_ERROR, detail)
                raise ValueError(f"room {room!r}: {detail}")
        except BaseException:
            for gathered in early.values():  # (already freed if the request ended)
                self.staging.free(gathered.region)
            raise

    # Messages ------------------------------------------------------------------------------

    def _on_message(self, peer: str, message: wire.Message) -> None:
        assert isinstance(message, wire.TO_PREFILL)  # Endpoint.step refused the others
        if isinstance(message, wire.RequestKV):
            self._streams.on_request_kv(peer, message)
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
        if message.ticket != stream.ticket:  # an earlier request's, with the same room id
            self.reject("stale_ticket", f"{message.type} for {message.room!r} ticket "
                        f"{message.ticket} from {peer}; the live request is ticket "
                        f"{stream.ticket}")
            return
        with self.guard(self._failer(transfer)):
            if isinstance(message, wire.Grant | wire.GrantRefused):
                self._parts.grant(transfer, stream, message)
            elif isinstance(message, wire.Watermark):
                out = stream.out.get(message.part if message.part is not None else -1)
                if out is not None and out.state is PartState.AWAITING_GRANT:
                    out.alloc_sent_at, out.retries = self.clock(), 0  # decode queued it
            elif isinstance(message, wire.Withdraw):
                if message.sender_id == stream.plan.sender_id:
                    self._parts.withdraw(transfer, stream)
                else:
                    self.reject("sender_mismatch", f"Withdraw for sender {message.sender_id}")
            elif isinstance(message, wire.Release):
                stream.released = True
                stream.written.clear()
                self._check_complete(transfer)
            elif isinstance(message, wire.Abort):
                self._fail(transfer, FailureReason.ABORTED_BY_PEER,
                           f"decode {peer}: {message.reason}: {message.detail}", notify=False)

    def _on_ring_update(self, peer: str, message: wire.RingUpdate) -> None:
        document = self.peers.get(peer)
        if document is None or document.role != "decode":
            self.reject("unknown_peer", f"RingUpdate from {peer}, not a known decode rank")
            return
        try:
            ring = RegionDoc(name=message.name, base_address=message.base_address,
                             size_bytes=message.size_bytes, kind=message.kind,
                             device_id=message.device_id)
        except ValueError as exc:  # pydantic's ValidationError
            self.reject("invalid_ring_update", f"from {peer}: {exc}")
            return
        if message.ring_version <= document.ring_version:
            if message.ring_version < document.ring_version:
                self.reject("stale_registration", f"RingUpdate {message.ring_version} from "
                            f"{peer}; version {document.ring_version} is in force")
            elif not _same_memory(ring, document.ring):
                self.reject("conflicting_registration", f"RingUpdate {message.ring_version} "
                            f"from {peer} announces another ring than the one in force")
            return  # else the announcement in force again (a new peer is told it)
        problem = _ring_problem(document, ring, message.ring_version)
        if problem is not None:
            self.reject("invalid_ring_update", f"from {peer}: {problem}")
            return
        # The message's MAC (checked at intake) proves ``peer`` sent it; the transport
        # loads the metadata only if it embeds that same name (docs/failure-modes.md #26).
        try:
            metadata = base64.b64decode(message.transport_metadata_b64, validate=True)
            if not self.transport.registers(metadata, ring.to_region(), expected_name=peer):
                self.reject("unregistered_ring", f"from {peer}: ring {ring.base_address:#x} "
                            f"+{ring.size_bytes} is not a buffer its metadata registers")
                return
            self.transport.add_peer(metadata, expected_name=peer)  # its registrations changed
        except (ValueError, TransportError) as exc:
            self.reject("invalid_ring_update", f"from {peer}: {exc}")
            return
        self.peers[peer] = document.model_copy(update={
            "ring": ring, "ring_version": message.ring_version,
            "transport_metadata_b64": message.transport_metadata_b64})
        _log.info("decode %s re-registered its ring: %d bytes, version %d", peer,
                  message.size_bytes, message.ring_version)

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
        self._parts.enqueue_gathers()
        if self.resizing:
            self._engine_gathers.disarm()  # no gather into the buffer being drained
            busy = self._step_resize() or busy
        return busy

    def _advance(self, transfer: SendTransfer, stream: _Stream) -> bool:
        busy = self._parts.make(transfer, stream)
        poster = self._poster
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
                    poster.post_direct(transfer, stream, out)
            if out.state is PartState.WAITING_STAGING and out.region is None:
                busy = self._parts.stage(transfer, stream, out) or busy
            elif out.state is PartState.AWAITING_GRANT and out.grant is not None:
                busy = poster.try_post_staged(transfer, stream, out) or busy
            elif out.state is PartState.AWAITING_GRANT:
                poster.gathered(out)  # stamps the gather's end while the grant is awaited
            elif out.state is PartState.WRITING and out.handle is not None:
                busy = poster.poll_write(transfer, stream, out) or busy
        return busy

    def _check_complete(self, transfer: SendTransfer) -> None:
        if transfer.delivered():
            self._apply(transfer, Event.COMPLETE)

    # Deadlines and endings -----------------------------------------------------------------

    def _check_deadlines(self, now: float) -> None:
        self._streams.expire_early(now)
        for transfer in list(self._transfers.values()):
            with self.guard(self._failer(transfer)):
                self._endings.check(transfer, now)

    def _release(self, transfer: SendTransfer) -> None:
        """Terminal: abort WRITEs in flight, free staging, forget the request. Runs once."""
        self._transfers.pop(transfer.room, None)
        self._endings.release(transfer)

    def _on_peer_lost(self, peer: str, detail: str) -> None:
        for transfer in list(self._transfers.values()):
            if peer in transfer.streams:
                self._fail(transfer, FailureReason.PEER_UNREACHABLE, detail, notify=False)


def _same_memory(ring: RegionDoc, other: RegionDoc | None) -> bool:
    return other is not None and (ring.base_address, ring.size_bytes, ring.kind,
                                  ring.device_id) == (other.base_address, other.size_bytes,
                                                      other.kind, other.device_id)


def _ring_problem(document: RankDocument, ring: RegionDoc, version: int) -> str | None:
    """Why a decode peer's announced ring of ``version`` cannot be its staging ring (module
    docstring), or None."""
    if version - document.ring_version > MAX_RING_VERSION_STEP:
        return (f"version {version} skips more than {MAX_RING_VERSION_STEP} past "
                f"{document.ring_version}, the version in force")
    current = document.ring
    if current is None:
        return "the peer published no staging ring, so it announces none"
    if (ring.kind, ring.device_id) != (current.kind, current.device_id):
        return (f"a {ring.kind} ring on device {ring.device_id}; its ring is {current.kind} on "
                f"device {current.device_id}")
    end = ring.base_address + ring.size_bytes
    for region in (*document.kv_regions, current):
        if ring.base_address < region.base_address + region.size_bytes and (
                region.base_address < end):
            what = "its ring in force" if region is current else f"KV region {region.name!r}"
            return (f"ring [{ring.base_address:#x}, {end:#x}) overlaps {what} "
                    f"[{region.base_address:#x}, {region.base_address + region.size_bytes:#x})")
    return None
