"""In-process ``Transport``: several agents on one ``LoopbackFabric``, for fast protocol tests.

Models what the protocol layer can observe of NIXL, and nothing faster than it:

* A posted WRITE is PENDING until the fabric is pumped (any ``state`` / ``poll_messages``
  call on any agent of the fabric pumps it); then the bytes are copied with torch between
  the registered tensors, and only then is the notification queued for the peer.
* Like a NIC, execution re-checks every span against the memory registered *now* on both
  sides (the peer may have deregistered since granting): outside it the transfer ends
  FAILED and nothing is written. The caller-side checks of ``descriptors.validate_write``
  run at post time exactly as in ``nixl.py``.
* ``kill`` models a dead process: posting or messaging it raises PeerUnreachable, its
  in-flight transfers end FAILED. Metadata names an incarnation, so a restarted agent with
  the same name is a new peer (docs/failure-modes.md #10).
* Faults are injected with ``FaultRule``: drop a message or a transfer's notification,
  delay delivery on the fabric clock, or fail a transfer (nothing written, no notification).
  A test with a ``ManualClock`` is deterministic.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from pd_transfer.errors import (
    PeerUnreachable,
    RegistrationError,
    TransportError,
)
from pd_transfer.transport.base import (
    MemoryKind,
    PreparedWrite,
    RegisteredRegion,
    Span,
    TransferHandle,
    TransferState,
    Transport,
    TransportStats,
)
from pd_transfer.transport.descriptors import RegionTable, ValidatedWrite, validate_write

__all__ = [
    "Envelope",
    "FaultAction",
    "FaultRule",
    "LoopbackFabric",
    "LoopbackTransport",
    "ManualClock",
]

_METADATA_MAGIC = b"pd-loopback/1\x00"
_MAX_METADATA_BYTES = 4096


class FaultAction(enum.Enum):
    """What an injected fault does to the operation it matches."""

    DROP = "drop"  # a message is never delivered; a transfer's data lands, its notification is lost
    DELAY = "delay"  # delivery (a transfer: copy and notification) waits ``delay_s`` longer
    FAIL = "fail"  # a transfer ends FAILED, nothing written; a message send raises PeerUnreachable


@dataclass(frozen=True)
class Envelope:
    """What a fault rule sees: one posted transfer or one control message."""

    kind: Literal["transfer", "message"]
    src: str
    dst: str
    payload: bytes  # the notification, for a transfer


def _always(_: Envelope) -> bool:
    return True


@dataclass
class FaultRule:
    """Apply ``action`` to the next ``remaining`` operations ``match`` accepts (None: forever).

    Rules are tried in injection order; the first that matches and has uses left applies.
    """

    action: FaultAction
    match: Callable[[Envelope], bool] = _always
    delay_s: float = 0.0
    remaining: int | None = 1
    applied: int = 0


class ManualClock:
    """A fabric clock that moves only when told, for deterministic delay tests."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class _Transfer:
    owner: LoopbackTransport
    dst: str
    dst_incarnation: int
    plan: ValidatedWrite
    notification: bytes | None  # None: dropped by a fault
    state: TransferState = TransferState.PENDING

    def finish(self, state: TransferState) -> None:
        self.state = state
        if state is TransferState.FAILED:
            self.owner._stats.transfers_failed += 1


@dataclass(order=True)
class _Due:
    at: float
    seq: int
    deliver: Callable[[], None] = field(compare=False)


class LoopbackFabric:
    """The shared "network": routes messages, executes transfers, injects faults."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._agents: dict[str, LoopbackTransport] = {}
        self._incarnations = itertools.count(1)
        self._queue: list[_Due] = []
        self._seq = itertools.count()
        self._rules: list[FaultRule] = []

    def create(self, name: str) -> LoopbackTransport:
        """A new live agent; raises TransportError if ``name`` is live already."""
        if name in self._agents:
            raise TransportError(f"loopback agent {name!r} already exists on this fabric")
        agent = LoopbackTransport(self, name, next(self._incarnations))
        self._agents[name] = agent
        return agent

    def inject(self, rule: FaultRule) -> FaultRule:
        """Arm ``rule``; returns it so a test can read ``applied`` afterwards."""
        self._rules.append(rule)
        return rule

    def clear_faults(self) -> None:
        self._rules.clear()

    def kill(self, name: str) -> None:
        """The agent's process dies: it leaves the fabric without any cleanup message."""
        agent = self._agents.pop(name, None)
        if agent is not None:
            agent._die()

    def pump(self) -> None:
        """Run every delivery that is due, in (due time, post order)."""
        now = self.clock()
        while self._queue and self._queue[0].at <= now:
            heapq.heappop(self._queue).deliver()

    # Used by LoopbackTransport -------------------------------------------------------------

    def _live(self, name: str, incarnation: int) -> LoopbackTransport | None:
        agent = self._agents.get(name)
        return agent if agent is not None and agent._incarnation == incarnation else None

    def _fault(self, envelope: Envelope) -> FaultRule | None:
        for rule in self._rules:
            if (rule.remaining is None or rule.remaining > 0) and rule.match(envelope):
                if rule.remaining is not None:
                    rule.remaining -= 1
                rule.applied += 1
                return rule
        return None

    def _schedule(self, delay_s: float, deliver: Callable[[], None]) -> None:
        heapq.heappush(self._queue, _Due(self.clock() + delay_s, next(self._seq), deliver))

    def _execute(self, transfer: _Transfer) -> None:
        """Do one transfer's copies, NIC-style: all spans re-checked, else FAILED."""
        if transfer.state is not TransferState.PENDING:
            return  # aborted by release, or its owner died
        src = transfer.owner
        dst = self._live(transfer.dst, transfer.dst_incarnation)
        pairs = _resolve_pairs(src, dst, transfer.plan) if dst is not None else None
        if dst is None or pairs is None:
            transfer.finish(TransferState.FAILED)
            return
        for dst_bytes, src_bytes in pairs:
            dst_bytes.copy_(src_bytes)
        if MemoryKind.VRAM in (transfer.plan.local_kind, transfer.plan.remote_kind):
            torch.cuda.synchronize()  # the notification must not overtake the data
        transfer.finish(TransferState.DONE)
        if transfer.notification is not None:
            dst._inbox.append((src.agent_name, transfer.notification))


def _resolve_pairs(
    src: LoopbackTransport, dst: LoopbackTransport, plan: ValidatedWrite
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    pairs = []
    for (l_addr, length, _), (r_addr, _, _) in zip(plan.local, plan.remote, strict=True):
        src_bytes = src._bytes_at(l_addr, length)
        dst_bytes = dst._bytes_at(r_addr, length)
        if src_bytes is None or dst_bytes is None:
            return None
        pairs.append((dst_bytes, src_bytes))
    return pairs


class LoopbackTransport(Transport):
    """One agent on a ``LoopbackFabric``; satisfies ``Transport``. Create via the fabric."""

    def __init__(self, fabric: LoopbackFabric, name: str, incarnation: int) -> None:
        self._fabric = fabric
        self._name = name
        self._incarnation = incarnation
        self._stats = TransportStats()
        self._regions = RegionTable()
        self._tensors: dict[str, torch.Tensor] = {}  # region name -> uint8 view (kept alive)
        self._peers: dict[str, int] = {}  # peer name -> incarnation from its metadata
        self._handles: dict[TransferHandle, _Transfer] = {}
        self._prepared: dict[PreparedWrite, tuple[ValidatedWrite, bytes]] = {}
        self._serials = itertools.count(1)
        self._inbox: list[tuple[str, bytes]] = []
        self._closed = False
        self._region_serials = itertools.count(1)

    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def stats(self) -> TransportStats:
        return self._stats

    def register(self, tensor: torch.Tensor, *, name: str | None = None) -> RegisteredRegion:
        self._check_open()
        if not tensor.is_contiguous() or tensor.numel() == 0:
            raise RegistrationError(
                f"register needs a non-empty contiguous tensor, got shape {tuple(tensor.shape)} "
                f"contiguous={tensor.is_contiguous()}"
            )
        kind = MemoryKind.VRAM if tensor.is_cuda else MemoryKind.DRAM
        region = RegisteredRegion(
            name=name or f"{self._name}/region-{next(self._region_serials)}",
            base_address=tensor.data_ptr(),
            size_bytes=tensor.numel() * tensor.element_size(),
            kind=kind,
            device_id=tensor.get_device() if tensor.is_cuda else 0,
        )
        self._regions.add(region)
        self._tensors[region.name] = tensor.reshape(-1).view(torch.uint8)
        return region

    def deregister(self, region: RegisteredRegion) -> None:
        if self._regions.remove(region):
            del self._tensors[region.name]

    def local_metadata(self) -> bytes:
        self._check_open()
        return _METADATA_MAGIC + f"{self._incarnation}\x00{self._name}".encode()

    def add_peer(self, metadata: bytes, *, expected_name: str) -> str:
        self._check_open()
        name, incarnation = _parse_metadata(metadata, expected_name)
        known = self._peers.get(name)
        if known is not None and incarnation < known:
            raise TransportError(
                f"metadata of {name!r} incarnation {incarnation} is older than the loaded "
                f"incarnation {known}: refused"
            )
        if known is not None:
            self._forget_prepared(name)  # built against the metadata being replaced
        self._peers[name] = incarnation
        return name

    def registers(self, metadata: bytes, region: RegisteredRegion, *,
                  expected_name: str) -> bool:
        self._check_open()
        name, incarnation = _parse_metadata(metadata, expected_name)
        agent = self._fabric._live(name, incarnation)  # the fabric stands for its memory
        return agent is not None and any(
            (r.base_address, r.size_bytes, r.kind, r.device_id)
            == (region.base_address, region.size_bytes, region.kind, region.device_id)
            for r in agent._regions)

    def remove_peer(self, name: str) -> None:
        self._peers.pop(name, None)
        self._forget_prepared(name)

    def prepare_write(
        self,
        peer: str,
        local: Sequence[Span],
        remote: Sequence[Span],
        remote_regions: Sequence[RegisteredRegion],
        notification: bytes,
    ) -> PreparedWrite:
        self._check_open()
        plan = validate_write(local, remote, self._regions, remote_regions)
        self._reachable(peer)
        prepared = PreparedWrite(self._name, next(self._serials), peer)
        self._prepared[prepared] = (plan, notification)
        return prepared

    def discard(self, prepared: PreparedWrite) -> None:
        self._prepared.pop(prepared, None)

    def post(self, prepared: PreparedWrite) -> TransferHandle:
        entry = self._prepared.pop(prepared, None)
        if entry is None:
            raise TransportError(f"{prepared} was not prepared by {self._name!r}, or was "
                                 f"posted or discarded")
        self._check_open()
        plan, notification = entry
        peer = prepared.peer
        incarnation = self._reachable(peer)  # (the data is read when the fabric runs it)
        rule = self._fabric._fault(Envelope("transfer", self._name, peer, notification))
        transfer = _Transfer(self, peer, incarnation, plan, notification)
        handle = TransferHandle(self._name, prepared.serial)
        self._handles[handle] = transfer
        self._stats.transfers_posted += 1
        self._stats.descriptors_posted += len(plan.local)
        self._stats.bytes_posted += plan.total_bytes
        action = rule.action if rule is not None else None
        if action is FaultAction.FAIL:
            transfer.finish(TransferState.FAILED)
            return handle
        if action is FaultAction.DROP:
            transfer.notification = None
        delay = rule.delay_s if rule is not None and action is FaultAction.DELAY else 0.0
        self._fabric._schedule(delay, lambda: self._fabric._execute(transfer))
        return handle

    def state(self, handle: TransferHandle) -> TransferState:
        transfer = self._handles.get(handle)
        if transfer is None:
            raise TransportError(f"{handle} was not issued by {self._name!r} or was released")
        if transfer.state is TransferState.PENDING:
            self._fabric.pump()
        return transfer.state

    def release(self, handle: TransferHandle) -> None:
        if handle.transport != self._name:
            raise TransportError(f"{handle} belongs to {handle.transport!r}, not {self._name!r}")
        transfer = self._handles.pop(handle, None)
        if transfer is not None and transfer.state is TransferState.PENDING:
            transfer.state = TransferState.FAILED  # aborted: the fabric skips it

    def send_message(self, peer: str, payload: bytes) -> None:
        self._check_open()
        incarnation = self._reachable(peer)
        rule = self._fabric._fault(Envelope("message", self._name, peer, payload))
        action = rule.action if rule is not None else None
        if action is FaultAction.FAIL:
            raise PeerUnreachable(peer, "injected send failure")
        self._stats.messages_sent += 1
        if action is FaultAction.DROP:
            return
        delay = rule.delay_s if rule is not None and action is FaultAction.DELAY else 0.0

        def deliver() -> None:
            target = self._fabric._live(peer, incarnation)
            if target is not None:
                target._inbox.append((self._name, payload))

        self._fabric._schedule(delay, deliver)

    def poll_messages(self) -> list[tuple[str, bytes]]:
        self._check_open()
        self._fabric.pump()
        received, self._inbox = self._inbox, []
        self._stats.messages_received += len(received)
        return received

    def close(self) -> None:
        if not self._closed:
            self._fabric.kill(self._name)

    # Internals -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"loopback agent {self._name!r} is closed")

    def _reachable(self, peer: str) -> int:
        incarnation = self._peers.get(peer)
        if incarnation is None:
            raise PeerUnreachable(peer, "not added (call add_peer with its metadata first)")
        if self._fabric._live(peer, incarnation) is None:
            raise PeerUnreachable(peer, f"incarnation {incarnation} is gone (process died)")
        return incarnation

    def _forget_prepared(self, peer: str) -> None:
        for prepared in [p for p in self._prepared if p.peer == peer]:
            del self._prepared[prepared]

    def _bytes_at(self, address: int, length: int) -> torch.Tensor | None:
        region = self._regions.find(address, length)
        if region is None:
            return None
        offset = address - region.base_address
        return self._tensors[region.name][offset : offset + length]

    def _die(self) -> None:
        self._closed = True
        self._regions = RegionTable()
        self._tensors.clear()
        self._peers.clear()
        self._prepared.clear()
        self._inbox.clear()
        for transfer in self._handles.values():
            if transfer.state is TransferState.PENDING:
                transfer.finish(TransferState.FAILED)
        self._handles.clear()


def _parse_metadata(metadata: bytes, expected_name: str) -> tuple[str, int]:
    """(agent name, incarnation) of loopback metadata naming ``expected_name``."""
    if not metadata.startswith(_METADATA_MAGIC) or len(metadata) > _MAX_METADATA_BYTES:
        raise TransportError(
            f"not loopback metadata ({len(metadata)} bytes, starts {metadata[:16]!r})"
        )
    try:
        text = metadata[len(_METADATA_MAGIC) :].decode()
        incarnation_text, _, name = text.partition("\x00")
        incarnation = int(incarnation_text)
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        raise TransportError(f"malformed loopback metadata: {exc}") from exc
    if name != expected_name:
        raise TransportError(
            f"loopback metadata names agent {name!r} but its authenticated sender is "
            f"{expected_name!r}: refused"
        )
    return name, incarnation
