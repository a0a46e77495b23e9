"""What the decode collaborators use of their endpoint, bound once by ``DecodeReceiver``.

The receiver owns its collaborators (``_Allocations``, ``_Arrivals``) and hands each this one
object instead of itself: the shared objects (pool, metrics, clock, part machine, the ring's
bookkeeping ``RingGrants``, the scatters, the live requests by room), the ring in force (read
through accessors: a resize replaces it), and the endpoint's request endings and messaging,
by name. Everything in it runs on the worker thread.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from pd_transfer.common.metrics import TransferMetrics
from pd_transfer.decode.grants import RingGrants
from pd_transfer.decode.scatter import _Scatters
from pd_transfer.decode.transfer import ReceiveTransfer
from pd_transfer.endpoint.types import ApplyEvent, FailRequest, PartFinished
from pd_transfer.kv.pool import KVPool
from pd_transfer.kv.ring import StagingRing
from pd_transfer.protocol import messages as wire
from pd_transfer.protocol.parts import PartMachine

__all__ = ["ReceiverContext"]


@dataclass(frozen=True, eq=False)
class ReceiverContext:
    """The endpoint as its collaborators see it (the ``Endpoint`` and ``DecodeReceiver``
    methods of the same names, bound)."""

    pool: KVPool
    metrics: TransferMetrics
    clock: Callable[[], float]
    part_machine: PartMachine
    grants: RingGrants  # the ring's bookkeeping (its ring is replaced in a resize)
    scatters: _Scatters
    transfers: dict[str, ReceiveTransfer]  # the endpoint's own dict: live requests by room
    resizing: Callable[[], bool]  # a resize of the ring is under way
    ring: Callable[[], StagingRing]  # the ring in force
    ring_version: Callable[[], int]  # its registration version
    ring_buffer: Callable[[], torch.Tensor]  # its memory
    ring_update: Callable[[], wire.RingUpdate]  # the RingUpdate announcing it
    send: Callable[[str, wire.Message], bool]
    reject: Callable[[str, str], None]
    guard: Callable[[ReceiveTransfer], AbstractContextManager[None]]  # fails only that request
    fail: FailRequest[ReceiveTransfer]
    violation: Callable[[ReceiveTransfer, str, str], None]
    apply: ApplyEvent[ReceiveTransfer]
    part_finished: PartFinished[ReceiveTransfer]
