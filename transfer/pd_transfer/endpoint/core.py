"""What prefill and decode endpoints share: commands, message intake, peers, statuses.

An endpoint is driven by exactly one thread (its ``Worker``, or a unit test calling
``step``): that thread alone touches the transport and the per-request state. Engine
threads talk to it only through ``submit`` (a command queue, answered by a Future) and
read published ``RequestStatus`` snapshots (``StatusBoard``).

A message is authenticated before it is decoded (``frames``: per pod pair where pods have
identities, #59), and one its side never receives (``RECEIVED_BY``) is refused first.
Per-request isolation (docs/failure-modes.md #12): everything done on behalf of one request
runs under ``guard``; an exception fails that request with InternalError and the loop goes
on. Peers are keyed by agent name, which carries an incarnation id; a peer that is
unreachable is pruned at once and every request bound to it fails with PeerUnreachable
(docs/failure-modes.md #10).

A request on either side is a ``Transfer`` (room, lifecycle, bytes, status); admitting one
(``_check_new``, ``_admit``) and ending one (``_fail`` tells its peers first, ``_violation``,
``_failer``, ``_abort``, ``_apply``) is done here for both. Its parts change state only
through ``part_machine`` (protocol/parts.py), whose refusals go to the metrics. Staging
resizes (``resize``: the size an ``AgentStaging`` gives this role) run through
``StagingResizes`` (``resize.py``) with the ``StagingSide`` each side gives; what is left to
a side is its protocol: ``_on_message``, ``_progress``, ``_check_deadlines``,
``_on_peer_lost``, ``_moving``, and its ``debug_counts``.
"""

from __future__ import annotations

import abc
import base64
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from pd_contract import transferagent
from pd_contract.transferagent import AgentStaging
from pd_transfer.common.metrics import PendingKV, TransferMetrics
from pd_transfer.common.phases import PartTimes, PhaseLog, RequestTimes
from pd_transfer.endpoint.frames import PeerFrames
from pd_transfer.endpoint.resize import StagingResizes, StagingSide
from pd_transfer.endpoint.statuses import StatusBoard
from pd_transfer.endpoint.transfer import Transfer
from pd_transfer.endpoint.types import (
    CUDA_POLL,
    PollIntervals,
    RankIdentity,
    ResizeResult,
    Timeouts,
)
from pd_transfer.errors import PeerUnreachable, RemoteProtocolError, TransportError
from pd_transfer.kv.pool import KVPool
from pd_transfer.kv.staging import StagingStream
from pd_transfer.protocol.lifecycle import Event, FailureReason, RequestStatus, Role
from pd_transfer.protocol.messages import (
    RECEIVED_BY,
    Abort,
    Message,
    RingUpdate,
    decode_message,
)
from pd_transfer.protocol.parts import PartMachine
from pd_transfer.transport.base import RegisteredRegion, Transport
from pd_transfer.trust.auth import SECRET_MAGIC, PeerAuth
from pd_transfer.trust.bootstrap import (
    RankDocument,
    RegionDoc,
    check_compatible,
    fetch_document,
)

__all__ = ["Endpoint"]

_log = logging.getLogger("pd_transfer")
T = TypeVar("T")
TransferT = TypeVar("TransferT", bound=Transfer)


class Endpoint(abc.ABC, Generic[TransferT]):
    """Base of PrefillSender and DecodeReceiver (see module docstring)."""

    role: Role

    def __init__(
        self,
        transport: Transport,
        pool: KVPool,
        identity: RankIdentity,
        *,
        auth: PeerAuth,
        staging: StagingSide[TransferT],
        timeouts: Timeouts | None = None,
        metrics: TransferMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        phases: PhaseLog | None = None,
        poll: PollIntervals | None = None,
    ) -> None:
        """``staging``: the side's staging memory, as a resize sees it (its callables may
        read attributes the side sets after this constructor; they run on resizes only).
        ``poll``: the worker's sleep caps while requests move data (default: CUDA_POLL for a
        CUDA pool; none on CPU, where the idle back-off applies throughout)."""
        self.transport = transport
        self.auth = auth  # the deployment's transfer key (docs/failure-modes.md #26)
        self.pod_identity = auth.pod_identity(self.role.value, identity.instance)  # #59
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
        self.frames = PeerFrames(auth, self.pod_identity, transport.agent_name)
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._statuses = StatusBoard()
        self._closed = False
        self._transfers: dict[str, TransferT] = {}  # live requests by room
        self._resizes = StagingResizes(
            staging, metrics=self.metrics, clock=clock, transfers=self._transfers.values,
            fail=lambda transfer, detail: self._fail(transfer, FailureReason.RESIZE_DEADLINE,
                                                     detail))
        self.part_machine = PartMachine(self.metrics.part_transition_refused)
        self.metrics.attach_pending(self.pending_kv)
        self.metrics.attach_vetting(lambda: transport.vetting)
        # CUDA: the stream this endpoint's gathers or scatters run on (bound to the worker's
        # thread by ``thread_started``); None on CPU, where they run in place.
        self._stream = StagingStream(pool.device) if pool.device.type == "cuda" else None
        identity.check_pool(pool)
        self.kv_regions = tuple(
            transport.register(tensor, name=f"{transport.agent_name}/kv-{index}")
            for index, tensor in enumerate(pool.registration_tensors())
        )

    # Engine-facing (any thread) -------------------------------------------------------------

    def pending_kv(self) -> PendingKV:
        """The KV of this rank's live requests, and how long the oldest has been live (any
        thread: the table is copied in one step under the GIL)."""
        transfers = list(self._transfers.values())
        if not transfers:
            return PendingKV(0, 0, 0.0)
        page_bytes = self.pool.layout.total_kv_bytes // self.pool.layout.num_pages
        oldest = min(transfer.created for transfer in transfers)
        return PendingKV(len(transfers), page_bytes * sum(t.pages for t in transfers),
                         max(0.0, self.clock() - oldest))

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
        return self._statuses.get(room)

    def request_tickets(self, room: str) -> dict[str, int]:
        """The peers live request ``room`` is bound to, each with the request's ticket on
        that pair (messages.Ticket); empty if it is not live. Diagnostics and tests."""
        transfer = self._transfers.get(room)
        return transfer.bound_peers() if transfer is not None else {}

    def abort(self, room: str, detail: str = "aborted by the engine") -> Future[None]:
        """Fail live request ``room`` Aborted (its peers are told); nothing if not live."""
        return self.submit(lambda: self._abort(room, detail))

    def forget(self, room: str) -> None:
        """Drop a finished request's status (the engine has read it)."""
        self._statuses.forget(room)

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
            credential=self.pod_identity.wire if self.pod_identity is not None else None,
        )

    @property
    def resizing(self) -> bool:
        """A staging resize is under way (no staging space is handed out meanwhile)."""
        return self._resizes.under_way

    def resize(self, staging: AgentStaging, deadline_s: float) -> Future[ResizeResult]:
        """Re-size this rank's staging, without restarting, to the size ``staging`` gives
        its role (``bytes_for``: prefill its buffer, decode its ring; the other size is not
        read). Any thread. Nothing is handed out while it drains; requests holding space at
        ``deadline_s`` fail ResizeDeadline. The Future yields a ``ResizeResult`` (at once if
        that size is in force) or raises ``ResizeError``: the old memory then stays."""
        return self.resize_bytes(staging.bytes_for(transferagent.Role(self.role.value)),
                                 deadline_s)

    def resize_bytes(self, new_bytes: int, deadline_s: float) -> Future[ResizeResult]:
        """``resize`` to ``new_bytes``, finer than the contract's MiB (tests, benchmarks); a
        size not positive or not aligned fails the Future with ``ResizeError``."""
        done: Future[ResizeResult] = Future()
        self.submit(lambda: self._resizes.begin(new_bytes, deadline_s, done))
        return done

    def restart_staging_high_water(self) -> None:
        """A report was written: the staging's high-water mark restarts from the bytes in use
        (decode: the ring, which snapshots report; prefill: its buffer). Any thread."""
        self._resizes.side.allocator().reset_high_water()

    def _step_resize(self) -> bool:
        """A step of the resize under way: True when it finished (either way)."""
        return self._resizes.step()

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
                if isinstance(message, RingUpdate) and not payload.startswith(SECRET_MAGIC):
                    self.reject("plaintext_secret", f"{message.type} from {peer} in a frame "
                                "that is not encrypted (it carries transport secrets)")
                    continue
                if self.role.value not in RECEIVED_BY[message.type]:
                    self.reject("wrong_direction",
                                f"{message.type} from {peer} to a {self.role.value} rank")
                    continue
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
        """``message`` framed for ``peer``: what every control message and WRITE notification
        travels as (``frames``; docs/failure-modes.md #26, #59)."""
        return self.frames.seal(peer, message)

    def authenticate(self, peer: str, payload: bytes) -> bytes:
        """The body of a frame ``peer`` sealed for this agent, checked before any decoding;
        a RemoteProtocolError otherwise: ``unauthenticated``, or ``unknown_peer`` from a peer
        whose document this rank has not checked (its pair key is not known yet)."""
        return self.frames.open(peer, payload)

    def prune_peer(self, peer: str, detail: str) -> None:
        """Forget ``peer`` and fail every request bound to it (docs/failure-modes.md #10, #19)."""
        if self.peers.pop(peer, None) is None:
            return
        self.frames.drop(peer)
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
        self._statuses.publish(status)

    def status_counts(self) -> dict[str, int]:
        return {"live_status": self._statuses.live_count()}

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
        self._resizes.cancel(detail)

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
            for peer, ticket in transfer.bound_peers().items():
                if peer != skip_peer and peer in self.peers:
                    self.send(peer, Abort(room=transfer.room, ticket=ticket,
                                          reason=reason.value, detail=detail[:1024]))
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

    # Peers -----------------------------------------------------------------------------------

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
        sealer = self.frames.pair_with(document)
        self.transport.add_peer(metadata, expected_name=name)
        self.peers[name] = document
        self.frames.add(name, sealer)
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
    def debug_counts(self) -> dict[str, int]:
        """Sizes of every per-request structure (docs/failure-modes.md #11 tests)."""

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
