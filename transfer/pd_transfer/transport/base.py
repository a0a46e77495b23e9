"""The transport contract: what the protocol layer may ask of NIXL (or of a stand-in).

No backend import here. ``nixl.py`` implements this over a real NIXL agent,
``loopback.py`` in-process for unit tests; the protocol layer depends only on this module.

Semantics every implementation keeps:

* **One owner thread.** A transport is not thread-safe; the thread that owns it drives all
  progress by calling ``state`` and ``poll_messages`` (there is no background progress by
  default: on a shared CPU a NIXL progress thread busy-spins a core).
* **A WRITE is one request.** ``write`` posts all descriptor pairs as one transfer request;
  ``notification`` reaches the peer's ``poll_messages`` only after every byte of that request
  landed. That notification (or our own ``state`` reaching DONE) is the only proof that data
  arrived (docs/failure-modes.md #9); a control message proves nothing about data.
* **Prepared WRITEs.** ``prepare_write`` does all of ``write`` but the post: the checks, the
  descriptors and the backend's request; ``post`` sends it, once. One never posted is freed
  with ``discard``, or with every other one to its peer by ``remove_peer`` or a reload of
  the peer's metadata (``add_peer`` again: what it was built against changed), or by
  ``close``. ``write`` is ``post(prepare_write(...))``.
* **Bounds before posting.** Every local descriptor must lie inside one region registered
  here, every remote one inside a region the peer granted (passed in by the caller), or
  ``write`` raises ``DescriptorOutOfBounds`` and posts nothing (docs/failure-modes.md #15).
* **Messages are unordered and unreliable across kinds.** Within one peer, messages of one
  kind arrive in send order; a control message and a transfer notification may overtake
  each other. Payloads are opaque bytes: the protocol layer tags and versions them.
* **A dead peer is an error, not a hang.** Posting to or messaging a peer whose process died
  raises ``PeerUnreachable``; a transfer in flight to it ends FAILED (docs/failure-modes.md #19).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "MemoryKind",
    "PreparedWrite",
    "RegisteredRegion",
    "Span",
    "TransferHandle",
    "TransferState",
    "Transport",
    "TransportStats",
    "VettingStats",
]

Span = tuple[int, int]
"""One descriptor: ``(address, length_bytes)`` in the process that owns the memory."""


class MemoryKind(enum.Enum):
    """Where registered memory lives (NIXL's DRAM_SEG / VRAM_SEG)."""

    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True)
class RegisteredRegion:
    """A registered, contiguous byte range: ``[base_address, base_address + size_bytes)``.

    The owner sends this to peers (over the control plane) so they can address it; a peer
    validates its remote descriptors against the regions it was told about. ``device_id`` is
    the CUDA ordinal for VRAM and 0 for DRAM (NIXL's convention).
    """

    name: str
    base_address: int
    size_bytes: int
    kind: MemoryKind
    device_id: int

    def __post_init__(self) -> None:
        if self.base_address <= 0 or self.size_bytes <= 0 or self.device_id < 0:
            raise ValueError(
                f"RegisteredRegion {self.name!r}: base_address ({self.base_address:#x}) and "
                f"size_bytes ({self.size_bytes}) must be positive, device_id "
                f"({self.device_id}) non-negative"
            )

    @property
    def end_address(self) -> int:
        """One past the last byte."""
        return self.base_address + self.size_bytes

    def contains(self, address: int, length: int) -> bool:
        """Whether ``[address, address + length)`` is non-empty and lies inside this region."""
        return length > 0 and self.base_address <= address and address + length <= self.end_address


class TransferState(enum.Enum):
    """Where a posted transfer is. DONE and FAILED are terminal."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferHandle:
    """Opaque ticket for one posted transfer; valid on the transport that issued it."""

    transport: str
    serial: int


@dataclass(frozen=True)
class PreparedWrite:
    """Opaque ticket for one WRITE prepared and not posted yet (``Transport.prepare_write``);
    valid on the transport that issued it until ``post`` or ``discard``."""

    transport: str
    serial: int
    peer: str


@dataclass(slots=True)
class TransportStats:
    """Monotonic counters a metrics exporter reads; only the owning transport writes them.

    ``descriptors_posted`` counts descriptor pairs handed to the backend (before any merging
    NIXL does), because descriptor count, not bytes, decides the cost of a scattered WRITE.
    """

    transfers_posted: int = 0
    descriptors_posted: int = 0
    bytes_posted: int = 0
    transfers_failed: int = 0
    messages_sent: int = 0
    messages_received: int = 0

    def snapshot(self) -> TransportStats:
        """A copy that later posts do not change."""
        return TransportStats(
            self.transfers_posted,
            self.descriptors_posted,
            self.bytes_posted,
            self.transfers_failed,
            self.messages_sent,
            self.messages_received,
        )


@dataclass
class VettingStats:
    """Monotonic counters of a transport's metadata vetting (``nixl_vetter``); only the
    owning vetter writes them."""

    starts: int = 0  # vetting processes started
    vetted: int = 0  # blobs a vetting process loaded cleanly
    refused: int = 0  # blobs its NIXL refused
    deaths: int = 0  # blobs that killed it or stalled it past the timeout (then killed)
    remembered: int = 0  # blobs refused as condemned before, without a vetting process


@runtime_checkable
class Transport(Protocol):
    """Moves bytes into a peer's registered memory and carries small messages.

    Peers are named by their agent name, which must be unique per process incarnation
    (include the pod UID and start time): metadata from a restarted peer is a new peer.
    """

    @property
    def agent_name(self) -> str:
        """This transport's name, as peers see it in ``poll_messages``."""
        ...

    @property
    def stats(self) -> TransportStats:
        """Live counters (see ``TransportStats``)."""
        ...

    @property
    def vetting(self) -> VettingStats:
        """A copy of the metadata vetting counters (zero for a transport that vets none)."""
        return VettingStats()

    def register(self, tensor: torch.Tensor, *, name: str | None = None) -> RegisteredRegion:
        """Register a contiguous tensor's memory (CPU → DRAM, CUDA → VRAM) for transfers.

        The transport keeps a reference to the tensor until ``deregister``. Register before
        publishing ``local_metadata``: peers only see regions registered at that time.
        Raises RegistrationError for a non-contiguous or empty tensor, a duplicate name, or
        overlap with a region already registered.
        """
        ...

    def deregister(self, region: RegisteredRegion) -> None:
        """Stop transfers from/into ``region``; idempotent."""
        ...

    def local_metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``add_peer`` to reach us (connection info + regions)."""
        ...

    def add_peer(self, metadata: bytes, *, expected_name: str) -> str:
        """Load a peer's ``local_metadata``; returns its agent name, ``expected_name``.

        Call only with metadata from an authenticated peer (a verified bootstrap document or
        RingUpdate, docs/failure-modes.md #26); ``expected_name`` is the agent name that peer
        claims there. The metadata is checked (size, framing, the name it embeds equals
        ``expected_name``) before the backend sees it; a refusal changes no transport state.
        Reloading a known peer's metadata (its registrations changed) replaces only its
        memory regions. Raises TransportError.
        """
        ...

    def registers(self, metadata: bytes, region: RegisteredRegion, *,
                  expected_name: str) -> bool:
        """Whether a peer's ``metadata`` (checked as ``add_peer`` checks it, NOT loaded)
        registers ``region``'s memory exactly: one registration of its address, size, kind
        and device. A peer's announcement of where to WRITE is checked with it (a ring must
        be a buffer the peer registered, not a slice of its KV pool: docs/failure-modes.md
        #26). Raises TransportError for metadata ``add_peer`` would refuse."""
        ...

    def remove_peer(self, name: str) -> None:
        """Forget a peer and disconnect (docs/failure-modes.md #10); idempotent, unknown names
        ignored."""
        ...

    def write(
        self,
        peer: str,
        local: Sequence[Span],
        remote: Sequence[Span],
        remote_regions: Sequence[RegisteredRegion],
        notification: bytes,
    ) -> TransferHandle:
        """Post one WRITE of ``local[i]`` into ``remote[i]`` for all i, as one request.

        ``remote_regions`` are the peer's regions it granted us; each remote span must lie in
        one of them and each local span in one region registered here, with equal lengths
        pairwise and one memory kind per side. ``notification`` is delivered to the peer
        after all the data landed.

        Raises DescriptorError / DescriptorOutOfBounds (nothing posted), PeerUnreachable
        (unknown or dead peer), TransportError (backend refused). Implementations that
        subclass ``Transport`` inherit this one: ``post(prepare_write(...))``.
        """
        return self.post(self.prepare_write(peer, local, remote, remote_regions, notification))

    def prepare_write(
        self,
        peer: str,
        local: Sequence[Span],
        remote: Sequence[Span],
        remote_regions: Sequence[RegisteredRegion],
        notification: bytes,
    ) -> PreparedWrite:
        """Everything ``write`` does but the post, with the same arguments and errors: the
        WRITE is then posted by ``post`` at the cost of the backend's post call alone."""
        ...

    def post(self, prepared: PreparedWrite) -> TransferHandle:
        """Post a prepared WRITE; the ticket is spent whether or not this raises.
        Raises PeerUnreachable (the peer's process is gone), TransportError (a ticket this
        transport did not issue, or one posted or discarded already, which includes every
        ticket to a peer removed or reloaded since; or the backend refused)."""
        ...

    def discard(self, prepared: PreparedWrite) -> None:
        """Free a prepared WRITE that will not be posted; idempotent."""
        ...

    def state(self, handle: TransferHandle) -> TransferState:
        """Progress the transport and report where ``handle`` is. Raises TransportError
        for a handle this transport did not issue or already released."""
        ...

    def release(self, handle: TransferHandle) -> None:
        """Free a handle; idempotent. Releasing a PENDING handle aborts the transfer (data
        may have partly landed) and raises TransportError if the backend cannot abort."""
        ...

    def send_message(self, peer: str, payload: bytes) -> None:
        """Send a control message carrying no data. Raises PeerUnreachable."""
        ...

    def poll_messages(self) -> list[tuple[str, bytes]]:
        """Progress the transport; return ``(peer name, payload)`` received since the last
        call: transfer notifications and control messages alike."""
        ...

    def close(self) -> None:
        """Release every handle and registration and drop all peers; idempotent."""
        ...
