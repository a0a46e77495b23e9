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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from pd_transfer.auth import outgoing_body
from pd_transfer.protocol.messages import Grant, decode_message
from pd_transfer.transport.base import (
    PreparedWrite,
    RegisteredRegion,
    Span,
    TransferHandle,
    TransferState,
    Transport,
    TransportStats,
)

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


class FaultyTransport(Transport):
    """A ``Transport`` delegating to ``inner`` except where ``plan`` says to misbehave."""

    def __init__(self, inner: Transport, plan: FaultPlan) -> None:
        self._inner = inner
        self._plan = plan
        self._failed: set[TransferHandle] = set()

    @property
    def agent_name(self) -> str:
        return self._inner.agent_name

    @property
    def stats(self) -> TransportStats:
        return self._inner.stats

    def register(self, tensor: torch.Tensor, *, name: str | None = None) -> RegisteredRegion:
        return self._inner.register(tensor, name=name)

    def deregister(self, region: RegisteredRegion) -> None:
        self._inner.deregister(region)

    def local_metadata(self) -> bytes:
        return self._inner.local_metadata()

    def add_peer(self, metadata: bytes, *, expected_name: str) -> str:
        return self._inner.add_peer(metadata, expected_name=expected_name)

    def remove_peer(self, name: str) -> None:
        self._inner.remove_peer(name)

    def prepare_write(
        self,
        peer: str,
        local: Sequence[Span],
        remote: Sequence[Span],
        remote_regions: Sequence[RegisteredRegion],
        notification: bytes,
    ) -> PreparedWrite:
        return self._inner.prepare_write(peer, local, remote, remote_regions, notification)

    def post(self, prepared: PreparedWrite) -> TransferHandle:
        handle = self._inner.post(prepared)
        if self._plan.fires("fail_writes"):
            self._failed.add(handle)
        return handle

    def discard(self, prepared: PreparedWrite) -> None:
        self._inner.discard(prepared)

    def state(self, handle: TransferHandle) -> TransferState:
        state = self._inner.state(handle)
        if handle in self._failed and state is not TransferState.PENDING:
            return TransferState.FAILED  # the data may have landed; the sender must not trust it
        return state

    def release(self, handle: TransferHandle) -> None:
        self._failed.discard(handle)
        self._inner.release(handle)

    def send_message(self, peer: str, payload: bytes) -> None:
        if self._plan.active() and isinstance(decode_message(outgoing_body(payload)), Grant) and (
                self._plan.fires("drop_grants")):
            return
        self._inner.send_message(peer, payload)

    def poll_messages(self) -> list[tuple[str, bytes]]:
        return self._inner.poll_messages()

    def close(self) -> None:
        self._inner.close()
