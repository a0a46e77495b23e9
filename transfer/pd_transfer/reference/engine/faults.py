"""TEST-ONLY fault injection for the reference engine (``POST /v1/faults``).

Faults live in a ``Transport`` wrapper the engine puts between its endpoints and NIXL, so
``sender.py`` and ``decode/`` carry no test hook at all: the protocol code sees exactly
what it would see if the network or a peer misbehaved.

- ``drop_grants``: outgoing ``Grant`` messages are dropped (a decode pod whose grants are
  lost). Prefill re-sends its AllocRequest, never hears back and fails GrantTimeout; decode
  sees the granted region never written and fails StalledWriter / AbortedByPeer.
- ``fail_writes``: posted WRITEs report FAILED (a prefill pod whose NIC errors out):
  TransportFailed on prefill, AbortedByPeer on decode.
- ``abort_requests``: the engine aborts each new request right after registering it
  (fastest deterministic failure: Aborted here, AbortedByPeer on the peer).

Each fault applies with ``probability`` (default 1) using a seeded generator, so a test
can ask for "30% failures" and get a reproducible sequence.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Literal

from pd_transfer.protocol.messages import Grant, decode_message
from pd_transfer.transport.base import (
    PreparedWrite,
    TransferHandle,
    TransferState,
    Transport,
)
from pd_transfer.transport.delegating import DelegatingTransport
from pd_transfer.trust.auth import outgoing_body

__all__ = ["FAULT_KINDS", "FaultKind", "FaultPlan", "FaultyTransport"]

FaultKind = Literal["drop_grants", "fail_writes", "abort_requests"]
FAULT_KINDS: tuple[FaultKind, ...] = ("drop_grants", "fail_writes", "abort_requests")


@dataclass(frozen=True)
class _Fault:
    probability: float


class FaultPlan:
    """The faults in force in this process (shared by every rank's transport)."""

    def __init__(self, seed: int = 0) -> None:
        self._lock = threading.Lock()
        self._faults: dict[FaultKind, _Fault] = {}
        self._rng = random.Random(seed)
        self.injected: dict[FaultKind, int] = dict.fromkeys(FAULT_KINDS, 0)

    def set(self, kind: FaultKind, probability: float = 1.0) -> None:
        with self._lock:
            self._faults[kind] = _Fault(probability)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def active(self) -> dict[str, float]:
        with self._lock:
            return {kind: fault.probability for kind, fault in self._faults.items()}

    def fires(self, kind: FaultKind) -> bool:
        """Whether ``kind`` applies to this event (counted when it does)."""
        with self._lock:
            fault = self._faults.get(kind)
            if fault is None or self._rng.random() >= fault.probability:
                return False
            self.injected[kind] += 1
            return True


class FaultyTransport(DelegatingTransport):
    """A ``Transport`` delegating to ``inner`` except where ``plan`` says to misbehave."""

    def __init__(self, inner: Transport, plan: FaultPlan) -> None:
        super().__init__(inner)
        self._plan = plan
        self._failed: set[TransferHandle] = set()

    def post(self, prepared: PreparedWrite) -> TransferHandle:
        handle = self.inner.post(prepared)
        if self._plan.fires("fail_writes"):
            self._failed.add(handle)
        return handle

    def state(self, handle: TransferHandle) -> TransferState:
        state = self.inner.state(handle)
        if handle in self._failed and state is not TransferState.PENDING:
            return TransferState.FAILED  # the data may have landed; the sender must not trust it
        return state

    def release(self, handle: TransferHandle) -> None:
        self._failed.discard(handle)
        self.inner.release(handle)

    def send_message(self, peer: str, payload: bytes) -> None:
        body = outgoing_body(payload) if self._plan.active() else None
        if body is not None and isinstance(decode_message(body), Grant) and (
                self._plan.fires("drop_grants")):
            return
        self.inner.send_message(peer, payload)

