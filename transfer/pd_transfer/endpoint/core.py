"""What prefill and decode endpoints share: peers, commands, message intake, statuses.

An endpoint is driven by exactly one thread (its ``Worker``, or a unit test calling
``step``): that thread alone touches the transport and the per-request state. Engine
threads talk to it only through ``submit`` (a command queue, answered by a Future) and
read published ``RequestStatus`` snapshots under a lock.

Per-request isolation (docs/failure-modes.md #12): everything done on behalf of one request runs
under
``_guard``; an exception fails that request with InternalError and the loop goes on.
Peers are keyed by agent name, which carries an incarnation id; a peer that is unreachable
is pruned at once and every request bound to it fails with PeerUnreachable (docs/failure-modes.md
#10).

A request on either side is a ``Transfer`` (room, lifecycle, bytes, status); admitting one
(``_check_new``, ``_admit``) and ending one (``_fail`` tells its peers first, ``_violation``,
``_failer``, ``_abort``, ``_apply``) is done here for both. Its parts change state only
through ``part_machine`` (protocol/parts.py), whose refusals go to the metrics.

Staging resizes (decode ring, prefill buffer) share one lifecycle, here: ``_begin_resize``
validates and records a ``PendingResize``; each ``_step_resize`` drains (the role stops
handing out staging space while ``resizing``), fails the requests still holding space at
the deadline (``_fail_staging_holders``), then swaps the memory (``_swap_staging``) and
finishes the Future. The role hooks say what the staging memory is and how it is swapped.
"""

from __future__ import annotations

import abc
import base64
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from pd_contract.config import TimeoutsConfig
from pd_contract.defaults import (
    BOOTSTRAP_SECONDS,
    GRANT_SECONDS,
    KV_LEASE_SECONDS,
    TRANSFER_SECONDS,
)
from pd_transfer.auth import PeerAuth, Purpose
from pd_transfer.bootstrap import (
    GeometryDoc,
    RankDocument,
    RegionDoc,
    check_compatible,
    fetch_document,
)
from pd_transfer.errors import PeerUnreachable, RemoteProtocolError, ResizeError, TransportError
from pd_transfer.layout import KVPool
from pd_transfer.metrics import TransferMetrics
from pd_transfer.phases import PartTimes, PhaseLog, RequestTimes
from pd_transfer.plan import Parallelism, RankCoord
from pd_transfer.protocol.lifecycle import Event, FailureReason, Lifecycle, RequestStatus, Role
from pd_transfer.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Message,
    decode_message,
    encode_message,
)
from pd_transfer.protocol.parts import PartMachine
from pd_transfer.ring import StagingRing
from pd_transfer.staging import StagingStream
from pd_transfer.transport.base import RegisteredRegion, Transport

__all__ = ["CUDA_POLL", "Endpoint", "PollIntervals", "RankIdentity", "ResizeResult", "Timeouts",
           "Transfer"]

_log = logging.getLogger("pd_transfer")
T = TypeVar("T")
TransferT = TypeVar("TransferT", bound="Transfer")
FINISHED_STATUSES = 16384  # bound on terminal statuses kept for polling (docs/failure-modes.md #11)


@dataclass(frozen=True)
class Timeouts:
    """Every wait of the protocol has one of these deadlines (docs/failure-modes.md #3)."""

    bootstrap_s: float = BOOTSTRAP_SECONDS  # decode: until every writer rank is known and asked
    grant_s: float = GRANT_SECONDS  # re-send an unanswered AllocRequest / RequestKV after this
    grant_retries: int = 5  # unanswered re-sends before GrantTimeout
    transfer_s: float = TRANSFER_SECONDS  # a request, from Transferring to a terminal state
    kv_lease_s: float = KV_LEASE_SECONDS  # prefill: hold KV at most this long without a RequestKV
    stall_s: float = 10.0  # decode: a granted region unwritten this long → StalledWriter
    quarantine_grace_s: float = 30.0  # keep a stalled writer's region this long

    @classmethod
    def from_config(cls, config: TimeoutsConfig) -> Timeouts:
        return cls(
            bootstrap_s=config.bootstrap_seconds,
            grant_s=config.grant_seconds,
            transfer_s=config.transfer_seconds,
            kv_lease_s=config.kv_lease_seconds,
            stall_s=max(4 * config.grant_seconds, config.transfer_seconds / 4),
            quarantine_grace_s=config.transfer_seconds,
        )


@dataclass(frozen=True)
class PollIntervals:
    """The longest the worker may sleep between steps (``Endpoint.poll_interval_s``):
    ``moving_s`` while a part of a request is in flight here (a grant, a WRITE's DONE or
    notification, a gather's or scatter's event is due), ``waiting_s`` while a request
    waits for its peer (decode: prefill's compute; prefill: decode's RequestKV)."""

    moving_s: float
    waiting_s: float


#: CUDA: a part's steps take microseconds (64 MiB moves in ~50 µs), so each poll-bound wait
#: on the critical path would cost up to a whole idle sleep (1 ms); a step costs ~30 µs of
#: host time, so 20 µs polls (~70 µs apart with the kernel's timer slack) cost under half a
#: core per rank, and only while data moves. Waiting for the peer polls at 200 µs.
CUDA_POLL = PollIntervals(moving_s=20e-6, waiting_s=200e-6)


@dataclass(frozen=True)
class ResizeResult:
    """A finished staging resize (``resize_ring`` / ``resize_buffer``)."""

    side: str  # "ring" (decode) or "buffer" (prefill)
    capacity_bytes: int  # the size now in force
    registration_version: int  # decode: the ring's new version; prefill: its buffer's
    duration_s: float
    failed_requests: int  # requests failed ResizeDeadline (still live at the deadline)


@dataclass
class PendingResize:
    """A resize under way on an endpoint's worker (at most one at a time)."""

    new_bytes: int
    started: float
    deadline: float
    future: Future[ResizeResult]
    failed_requests: int = 0


@dataclass(frozen=True)
class RankIdentity:
    """Who this endpoint is in its deployment."""

    instance: str
    coord: RankCoord
    parallelism: Parallelism
    geometry: GeometryDoc


class Transfer(abc.ABC):
    """What every request has on either side: its room, lifecycle, bytes and status."""

    role: ClassVar[Role]

    def __init__(self, room: str, created: float, release: Callable[[], None]) -> None:
        self.room = room
        self.created = created
        self.transfer_deadline = float("inf")
        self.bytes = 0
        self.lifecycle = Lifecycle(release)  # ``release`` runs once, on the terminal state
        self.part_times: list[PartTimes] = []  # finished parts' stamps (with a PhaseLog)

    @abc.abstractmethod
    def bound_peers(self) -> list[str]:
        """The peers this request is bound to (told with an Abort when it fails)."""

    def status(self, now: float) -> RequestStatus:
        return RequestStatus(
            self.room, self.role, self.lifecycle.state, self.lifecycle.reason,
            self.lifecycle.detail, self.bytes, now - self.created,
        )


class Endpoint(abc.ABC, Generic[TransferT]):
    """Base of PrefillSender and DecodeReceiver (see module docstring)."""

    role: Role
    staging_side: ClassVar[str]  # "ring" (decode) or "buffer" (prefill): what a resize swaps

    def __init__(
        self,
        transport: Transport,
        pool: KVPool,
        identity: RankIdentity,
        *,
        auth: PeerAuth,
        timeouts: Timeouts | None = None,
        metrics: TransferMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        phases: PhaseLog | None = None,
        poll: PollIntervals | None = None,
    ) -> None:
        """``poll``: the worker's sleep caps while requests move data (default: CUDA_POLL
        for a CUDA pool; none on CPU, where the idle back-off applies throughout)."""
        self.transport = transport
        self.auth = auth  # the deployment's transfer key (docs/failure-modes.md #26)
        self.pool = pool
        self.identity = identity
        self.timeouts = timeouts or Timeouts()
        self.metrics = metrics or TransferMetrics(self.role)
        self.clock = clock
        self.phases = phases  # finished requests' part stamps go here (benchmarks)
        self.poll_intervals = poll if poll is not None else (
            CUDA_POLL if pool.device.type == "cuda" else None)
        self.wakeup = threading.Event()  # set by submit: the worker starts a command at once
        self.peers: dict[str, RankDocument] = {}
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._status_lock = threading.Lock()
        self._live_status: dict[str, RequestStatus] = {}
        self._finished_status: OrderedDict[str, RequestStatus] = OrderedDict()
        self._closed = False
        self._resize: PendingResize | None = None
        self._transfers: dict[str, TransferT] = {}  # live requests by room
        self.part_machine = PartMachine(self.metrics.part_transition_refused)
        # CUDA: the stream this endpoint's gathers or scatters run on (bound to the worker's
        # thread by ``thread_started``); None on CPU, where they run in place.
        self._stream = StagingStream(pool.device) if pool.device.type == "cuda" else None
        _check_pool_format(pool, identity.geometry)
        self.kv_regions = tuple(
            transport.register(tensor, name=f"{transport.agent_name}/kv-{index}")
            for index, tensor in enumerate(pool.registration_tensors())
        )

    # Engine-facing (any thread) -------------------------------------------------------------

    def submit(self, command: Callable[[], T]) -> Future[T]:
        """Run ``command`` on the endpoint's thread at its next step; thread-safe."""
        future: Future[T] = Future()
        self._commands.put((command, future))
        self.wakeup.set()
        return future

    def add_peer(self, address: str, timeout_s: float | None = None) -> Future[str]:
        """Fetch and check a peer's bootstrap document here, then connect on the worker.

        Raises BootstrapError / GeometryMismatch at once; the Future yields the peer's
        agent name once the transport knows it.
        """
        document = fetch_document(address, timeout_s or self.timeouts.bootstrap_s, self.auth)
        check_compatible(self.identity.geometry, document, address)
        return self.add_peer_document(document)

    def add_peer_document(self, document: RankDocument) -> Future[str]:
        """Connect to a peer whose (already checked) document is at hand."""
        return self.submit(lambda: self._connect(document))

    def poll(self, room: str) -> RequestStatus | None:
        """The latest status of ``room`` (live or recently finished), None if unknown."""
        with self._status_lock:
            status = self._live_status.get(room)
            return status if status is not None else self._finished_status.get(room)

    def forget(self, room: str) -> None:
        """Drop a finished request's status (the engine has read it)."""
        with self._status_lock:
            self._finished_status.pop(room, None)

    def document(self) -> RankDocument:
        """This rank's bootstrap document (for ``BootstrapServer``)."""
        ident = self.identity
        ring = self._ring_region()
        return RankDocument(
            role=self.role.value,
            instance=ident.instance,
            agent_name=self.transport.agent_name,
            pp_rank=ident.coord.pp_rank,
            tp_rank=ident.coord.tp_rank,
            pp=ident.parallelism.pp,
            tp=ident.parallelism.tp,
            geometry=ident.geometry,
            num_pages=self.pool.layout.num_pages,
            kv_regions=tuple(RegionDoc.of(r) for r in self.kv_regions),
            layer_bases=self.pool.base_table(),
            ring=RegionDoc.of(ring) if ring is not None else None,
            ring_version=self._ring_version(),
            transport_metadata_b64=base64.b64encode(self.transport.local_metadata()).decode(),
        )

    @property
    def resizing(self) -> bool:
        """A staging resize is under way (no staging space is handed out meanwhile)."""
        return self._resize is not None

    def _request_resize(self, new_bytes: int, deadline_s: float) -> Future[ResizeResult]:
        done: Future[ResizeResult] = Future()
        self.submit(lambda: self._begin_resize(new_bytes, deadline_s, done))
        return done

    # Worker-facing -------------------------------------------------------------------------

    def thread_started(self) -> None:
        """On CUDA, make the worker's thread enqueue all its CUDA work (page-id uploads,
        layer tables, resized buffers) on the staging stream, ahead of the gathers or
        scatters that read it (``StagingStream.bind``)."""
        if self._stream is not None:
            self._stream.bind()

    def step(self) -> bool:
        """One round: commands, messages, transfer progress, deadlines. True if it did work."""
        busy = False
        while True:
            try:
                command, future = self._commands.get_nowait()
            except queue.Empty:
                break
            busy = True
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(command())
                except Exception as exc:  # the command's caller gets it through the Future
                    future.set_exception(exc)
        for peer, payload in self.transport.poll_messages():
            busy = True
            try:
                message = decode_message(self.authenticate(peer, payload))
                self._on_message(peer, message)
            except RemoteProtocolError as exc:
                self.reject(exc.reason, f"from {peer}: {exc.detail}")
            except Exception as exc:  # outside any request's guard: the batch goes on
                _log.exception("handling a message from %s failed", peer)
                self.reject("handler_error", f"from {peer}: {type(exc).__name__}: {exc}")
        try:
            busy = self._progress() or busy
        except Exception:  # a request's own errors are guarded inside; deadlines still run
            _log.exception("transfer progress failed")
            busy = True
        self._check_deadlines(self.clock())
        return busy

    def poll_interval_s(self) -> float | None:
        """The longest the worker may sleep now (``PollIntervals``; None: no cap)."""
        intervals = self.poll_intervals
        if intervals is None or not self._transfers:
            return None
        return intervals.moving_s if self._moving() else intervals.waiting_s

    def close(self) -> None:
        """Fail every live request (Aborted), then close the transport. Call on the worker
        thread, or after the worker stopped."""
        if self._closed:
            return
        self._closed = True
        self._abort_all("endpoint closed")
        self.transport.close()

    # Shared helpers --------------------------------------------------------------------------

    def reject(self, reason: str, detail: str) -> None:
        """Count a refused peer message (docs/failure-modes.md #15); it is never acted on."""
        _log.debug("rejected message (%s): %s", reason, detail)
        self.metrics.message_rejected(reason)

    def send(self, peer: str, message: Message) -> bool:
        """Send a control message; on PeerUnreachable prune the peer. Never blocks long."""
        return self.send_sealed(peer, self.seal(peer, message))

    def send_sealed(self, peer: str, frame: bytes) -> bool:
        """``send`` of a message sealed already (``seal``): a WRITE's notification again."""
        try:
            self.transport.send_message(peer, frame)
        except PeerUnreachable as exc:
            self.prune_peer(peer, str(exc))
            return False
        except TransportError as exc:
            _log.warning("send to %s failed: %s", peer, exc)
            return False
        return True

    def seal(self, peer: str, message: Message) -> bytes:
        """``message`` framed for ``peer`` with the transfer key: what every control message
        and WRITE notification travels as (docs/failure-modes.md #26)."""
        return self.auth.seal(encode_message(message), purpose=Purpose.MESSAGE,
                              version=PROTOCOL_VERSION, sender=self.transport.agent_name,
                              receiver=peer)

    def authenticate(self, peer: str, payload: bytes) -> bytes:
        """The body of a frame ``peer`` sealed for this agent, checked before any decoding;
        Unauthenticated (a RemoteProtocolError, counted as ``unauthenticated``) otherwise."""
        return self.auth.open(payload, purpose=Purpose.MESSAGE, version=PROTOCOL_VERSION,
                              sender=peer, receiver=self.transport.agent_name)

    def prune_peer(self, peer: str, detail: str) -> None:
        """Forget ``peer`` and fail every request bound to it (docs/failure-modes.md #10, #19)."""
        if self.peers.pop(peer, None) is None:
            return
        _log.warning("pruning peer %s: %s", peer, detail)
        self.transport.remove_peer(peer)
        self._on_peer_lost(peer, detail)

    @contextmanager
    def guard(self, fail: Callable[[str], None]) -> Iterator[None]:
        """Run a request's processing; an exception calls ``fail(detail)`` and is swallowed."""
        try:
            yield
        except Exception as exc:
            _log.exception("internal error in request processing")
            fail(f"{type(exc).__name__}: {exc}")

    def publish(self, status: RequestStatus) -> None:
        with self._status_lock:
            if status.finished:
                self._live_status.pop(status.room, None)
                self._finished_status[status.room] = status
                self._finished_status.move_to_end(status.room)
                while len(self._finished_status) > FINISHED_STATUSES:
                    self._finished_status.popitem(last=False)
            else:
                self._live_status[status.room] = status

    def status_counts(self) -> dict[str, int]:
        with self._status_lock:
            return {"live_status": len(self._live_status)}

    # Requests: admission and endings (both sides) ------------------------------------------

    def _check_new(self, room: str, pages: list[int], num_tokens: int, known_as: str) -> None:
        """Refuse (ValueError) a new request: its room is live already (``known_as``: how the
        engine gave it), or its pages cannot hold its tokens in this rank's pool."""
        layout = self.pool.layout
        if room in self._transfers:
            raise ValueError(f"room {room!r} is already {known_as}")
        if not pages or num_tokens <= 0 or num_tokens > len(pages) * layout.page_size:
            raise ValueError(f"room {room!r}: {num_tokens} tokens do not fit {len(pages)} pages")
        if min(pages) < 0 or max(pages) >= layout.num_pages or len(set(pages)) != len(pages):
            raise ValueError(
                f"room {room!r}: page ids must be distinct, in [0, {layout.num_pages})")

    def _admit(self, transfer: TransferT) -> None:
        self._transfers[transfer.room] = transfer
        self.metrics.request_started()
        self.publish(transfer.status(self.clock()))

    def _abort(self, room: str, detail: str) -> None:
        transfer = self._transfers.get(room)
        if transfer is not None:
            self._fail(transfer, FailureReason.ABORTED, detail)

    def _abort_all(self, detail: str) -> None:
        for transfer in list(self._transfers.values()):
            self._fail(transfer, FailureReason.ABORTED, detail)
        self._cancel_resize(detail)

    def _failer(self, transfer: TransferT) -> Callable[[str], None]:
        """What ``guard`` calls when processing ``transfer`` raised: fail only it."""
        return lambda detail: self._fail(transfer, FailureReason.INTERNAL_ERROR, detail)

    def _violation(self, transfer: TransferT, peer: str, detail: str) -> None:
        """``peer`` broke the protocol for ``transfer``: count it, fail only that request."""
        self.reject("protocol_violation", f"{peer}: {detail}")
        self._fail(transfer, FailureReason.PROTOCOL_VIOLATION, f"{peer}: {detail}")

    def _fail(
        self, transfer: TransferT, reason: FailureReason, detail: str,
        *, skip_peer: str | None = None, notify: bool = True,
    ) -> None:
        """Fail ``transfer`` (once): its live peers but ``skip_peer`` get an Abort first,
        unless ``notify`` is False."""
        if transfer.lifecycle.finished:
            return
        if notify:
            for peer in transfer.bound_peers():
                if peer != skip_peer and peer in self.peers:
                    self.send(peer, Abort(room=transfer.room, reason=reason.value,
                                          detail=detail[:1024]))
            if transfer.lifecycle.finished:
                return  # a send found its peer gone, and pruning the peer failed it first
        self._apply(transfer, Event.FAIL, reason, detail)

    def _apply(self, transfer: TransferT, event: Event, reason: FailureReason | None = None,
               detail: str = "") -> None:
        transfer.lifecycle.apply(event, reason, detail)
        now = self.clock()
        self.publish(transfer.status(now))
        if transfer.lifecycle.finished:
            self.metrics.request_finished(transfer.room, reason, detail, now - transfer.created)
            if self.phases is not None:
                self.phases.add(RequestTimes(
                    transfer.room, self.role.value, transfer.lifecycle.state.value,
                    transfer.created, now, tuple(transfer.part_times)))

    def _part_finished(  # noqa: PLR0917 - private; both sides name every field
        self, transfer: TransferT, peer: str, sender_id: int, part: int, path: str,
        size_bytes: int, stamps: dict[str, float],
    ) -> None:
        """Keep a finished part's stamps for the request's ``RequestTimes`` (with a log)."""
        if self.phases is not None:
            transfer.part_times.append(
                PartTimes(peer, sender_id, part, path, size_bytes, stamps))

    # Staging resizes (module docstring) ---------------------------------------------------

    def _begin_resize(self, new_bytes: int, deadline_s: float,
                      done: Future[ResizeResult]) -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            if self._resize is not None:
                raise ResizeError(f"a resize to {self._resize.new_bytes} bytes is under way")
            if deadline_s < 0:
                raise ResizeError(f"deadline_s must be >= 0, got {deadline_s}")
            StagingRing(new_bytes)  # validates the size (positive, aligned)
        except (ResizeError, ValueError) as exc:
            done.set_exception(exc if isinstance(exc, ResizeError) else ResizeError(str(exc)))
            return
        if new_bytes == self._staging_pool().capacity_bytes:
            # Already in force (a spec change that moved only the other side's size): no
            # drain, no re-registration, nothing for the peers to learn.
            done.set_result(ResizeResult(self.staging_side, new_bytes, self._staging_version(),
                                         0.0, 0))
            return
        now = self.clock()
        self._resize = PendingResize(new_bytes, now, now + deadline_s, done)
        self.metrics.resize_started()
        _log.info("resizing the staging %s: %d → %d bytes (deadline %.1f s)",
                  self.staging_side, self._staging_pool().capacity_bytes, new_bytes, deadline_s)
        self._step_resize()

    def _step_resize(self) -> bool:
        """Drain, then swap: True when the resize finished (either way) in this step."""
        resize = self._resize
        assert resize is not None
        if self._staging_pool().live_regions and self.clock() >= resize.deadline:
            resize.failed_requests += self._fail_staging_holders(
                f"its staging space was still in use when the {self.staging_side} resize to "
                f"{resize.new_bytes} bytes reached its deadline")
        if self._staging_pool().live_regions:
            return False
        self._resize = None
        try:
            self._swap_staging(resize.new_bytes)
        except Exception as exc:
            _log.exception("staging %s resize failed; the old one stays in force",
                           self.staging_side)
            self._end_resize(resize, ResizeError(
                f"resize to {resize.new_bytes} bytes failed: {type(exc).__name__}: {exc}"))
        else:
            self._end_resize(resize, None)
        return True

    def _fail_staging_holders(self, detail: str) -> int:
        """Fail (ResizeDeadline) every request still holding staging space; how many."""
        failed = 0
        for transfer in list(self._transfers.values()):
            if self._holds_staging(transfer):
                failed += 1
                self._fail(transfer, FailureReason.RESIZE_DEADLINE, detail)
        return failed

    def _cancel_resize(self, detail: str) -> None:
        """Fail a resize under way (the endpoint is closing)."""
        if self._resize is not None:
            resize, self._resize = self._resize, None
            self._end_resize(resize, ResizeError(f"resize to {resize.new_bytes} bytes: {detail}"))

    def _end_resize(self, resize: PendingResize, error: Exception | None) -> None:
        duration = self.clock() - resize.started
        capacity, version = self._staging_pool().capacity_bytes, self._staging_version()
        self.metrics.resize_finished(self.staging_side, ok=error is None, duration_s=duration,
                                     staging_bytes=capacity, registration_version=version)
        if error is not None:
            resize.future.set_exception(error)
            return
        _log.info("staging %s resized to %d bytes (version %d) in %.3f s; %d requests failed "
                  "ResizeDeadline", self.staging_side, capacity, version, duration,
                  resize.failed_requests)
        resize.future.set_result(ResizeResult(self.staging_side, capacity, version, duration,
                                              resize.failed_requests))

    def _connect(self, document: RankDocument) -> str:
        """Load an authenticated peer's metadata under the agent name its document claims.

        A connected peer's entry is never replaced here (its registrations change only
        through its own authenticated RingUpdate; a restarted peer has a new agent name), so
        the same document again, or a stale one, changes nothing. A refusal (TransportError)
        changes no transport state (docs/failure-modes.md #26).
        """
        name = document.agent_name
        if name == self.transport.agent_name:
            raise TransportError(f"peer document names this rank's own agent {name!r}")
        if name in self.peers:
            return name
        try:
            metadata = base64.b64decode(document.transport_metadata_b64, validate=True)
        except ValueError as exc:
            raise TransportError(f"peer {name!r}: transport metadata is not base64: {exc}") from exc
        self.transport.add_peer(metadata, expected_name=name)
        self.peers[name] = document
        self._on_peer_added(document)
        return name

    # Role hooks ------------------------------------------------------------------------------

    def _ring_region(self) -> RegisteredRegion | None:
        return None

    def _ring_version(self) -> int:
        return 0

    def _on_peer_added(self, document: RankDocument) -> None:
        return None

    @abc.abstractmethod
    def _moving(self) -> bool:
        """A live request has a part in flight on this side (``PollIntervals.moving_s``)."""

    @abc.abstractmethod
    def _on_message(self, peer: str, message: Message) -> None: ...

    @abc.abstractmethod
    def _progress(self) -> bool: ...

    @abc.abstractmethod
    def _check_deadlines(self, now: float) -> None: ...

    @abc.abstractmethod
    def _on_peer_lost(self, peer: str, detail: str) -> None: ...

    @abc.abstractmethod
    def _staging_pool(self) -> StagingRing:
        """The staging memory's allocator in force (decode: the ring; prefill: its buffer)."""

    @abc.abstractmethod
    def _staging_version(self) -> int:
        """The registration version of the staging memory in force."""

    @abc.abstractmethod
    def _holds_staging(self, transfer: TransferT) -> bool:
        """``transfer`` holds staging space (a resize waits for it, or fails it)."""

    @abc.abstractmethod
    def _swap_staging(self, new_bytes: int) -> None:
        """Register new staging memory of ``new_bytes`` in place of the drained one (on an
        error the old one must stay registered and in force)."""


def _check_pool_format(pool: KVPool, geometry: GeometryDoc) -> None:
    """The pool must be laid out as the geometry this rank publishes says."""
    layout = pool.layout
    if (layout.page_format.value, layout.packing.value) != (geometry.page_format,
                                                            geometry.packing):
        raise ValueError(
            f"the pool has {layout.page_format.value} pages packed {layout.packing.value} but "
            f"the rank's geometry says {geometry.page_format}/{geometry.packing}"
        )
