"""What the prefill collaborators use of their endpoint, bound once by ``PrefillSender``.

The sender owns its collaborators (``StreamOpener``, ``PartMaker``, ``EngineGathers``,
``Poster``, ``Endings``) and hands each this one object instead of itself: the shared
objects (transport, pool, metrics, the peers' documents, the staging buffer), the
endpoint's counters, and its request endings and messaging, by name. Everything in it runs
on the worker thread, except what ``EngineGathers.launch`` reads on the engine's thread (module
docstring of gathers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from pd_transfer.common.metrics import TransferMetrics
from pd_transfer.endpoint import RankIdentity, Timeouts
from pd_transfer.endpoint.types import ApplyEvent, FailRequest, PartFinished
from pd_transfer.kv.plan import LayerRange, Parallelism, TransferTopology, compute_transfer_topology
from pd_transfer.kv.pool import KVPool
from pd_transfer.kv.staging import StagingStream
from pd_transfer.prefill.buffer import StagingBuffer
from pd_transfer.prefill.transfer import SendTransfer, _Stream
from pd_transfer.protocol import messages as wire
from pd_transfer.protocol.parts import PartMachine
from pd_transfer.transport.base import Transport
from pd_transfer.trust.bootstrap import RankDocument

__all__ = ["SendCounts", "SenderContext"]


class SendCounts(Protocol):
    """The endpoint's counters its collaborators add to (``PrefillSender`` holds them)."""

    alloc_requests_sent: int  # first sends only (docs/failure-modes.md #1 counts these)
    pregrants_taken: int  # parts 0 written into their RequestKV's pre-grant instead
    prepared_writes_posted: int  # parts 0 posted with the WRITE prepared at arming


@dataclass(frozen=True, eq=False)
class SenderContext:
    """The endpoint as its collaborators see it (the ``Endpoint`` methods of the same
    names, bound)."""

    identity: RankIdentity
    transport: Transport
    pool: KVPool
    metrics: TransferMetrics
    timeouts: Timeouts
    clock: Callable[[], float]
    part_machine: PartMachine
    peers: dict[str, RankDocument]  # the endpoint's own dict: connected peers by agent name
    stream: StagingStream | None  # CUDA: the staging stream gathers run on
    stage: LayerRange  # this rank's layers
    buffer: StagingBuffer
    counts: SendCounts
    resizing: Callable[[], bool]  # a resize of this rank's buffer is under way
    send: Callable[[str, wire.Message], bool]
    send_sealed: Callable[[str, bytes], bool]
    seal: Callable[[str, wire.Message], bytes]
    reject: Callable[[str, str], None]
    prune_peer: Callable[[str, str], None]
    guard: Callable[[SendTransfer], AbstractContextManager[None]]  # fails only that request
    fail: FailRequest[SendTransfer]
    violation: Callable[[SendTransfer, str, str], None]
    apply: ApplyEvent[SendTransfer]
    part_finished: PartFinished[SendTransfer]

    def peer_document(self, stream: _Stream) -> RankDocument:
        """The peer's document in force (its ring may have been re-registered since the
        stream opened)."""
        return self.peers.get(stream.peer, stream.document)

    def topology(self, decode: Parallelism) -> TransferTopology:
        """Which of this deployment's ranks write to which decode ranks of ``decode``."""
        return compute_transfer_topology(self.identity.geometry.kv_geometry(),
                                         self.identity.parallelism, decode)
