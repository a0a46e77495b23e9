"""Exceptions raised by pd_transfer, classified by what the caller should do next.

Hierarchy (add new families as direct children of ``TransferError``, next to
``TransportError``; keep one class per distinct caller action)::

    TransferError                   base of everything pd_transfer raises
    ├── PlanError                   a topology/layout cannot be planned (fix the config)
    ├── RingError                   the staging ring's bookkeeping is inconsistent
    │   └── OversizedAllocation     a chunk larger than the whole ring: fail only that
    │                               request (docs/failure-modes.md #6)
    ├── TransportError              the data/control path below the protocol failed
    │   ├── PeerUnreachable         peer unknown, removed, dead or disconnected:
    │   │                           fail its requests, prune it, wait for new metadata
    │   ├── RegistrationError       memory could not be registered / deregistered
    │   └── DescriptorError         a descriptor list is malformed: a local bug,
    │       │                       nothing was posted
    │       └── DescriptorOutOfBounds
    │                               a descriptor leaves registered memory (ours, or
    │                               what the peer granted us): rejected before posting
    ├── ProtocolError               the transfer protocol was broken
    │   ├── LocalProtocolError      we asked a request for an illegal transition (a
    │   │                           local bug): refused, the request's state unchanged
    │   └── RemoteProtocolError     a peer's message is malformed, hostile or out of
    │                               place: rejected and counted by ``reason``, never
    │                               acted on
    └── BootstrapError              a peer's bootstrap document could not be fetched or
        │                           is unusable: retry later or fix the deployment
        └── GeometryMismatch        the peer's KV geometry differs from ours: fix the
                                    config (both values are in the message)

Every class carries a stable ``code`` (for metric labels and status reasons); the
message names the offending values and, where there is one, the fix.

Third-party errors (NIXL, UCX) are wrapped at the boundary and chained with
``raise ... from exc`` so callers never need to import a backend to catch them.
"""

from __future__ import annotations

from typing import ClassVar


class TransferError(Exception):
    """Base of every error raised by pd_transfer."""

    code: ClassVar[str] = "transfer_error"


class ResizeError(TransferError):
    """A staging resize was refused or failed; the size in force is unchanged."""

    code: ClassVar[str] = "resize_failed"


class PlanError(TransferError):
    """A parallelism/layout combination cannot be planned; the message says what to change."""

    code: ClassVar[str] = "plan_invalid"


class RingError(TransferError):
    """The staging ring refused an operation or found its bookkeeping inconsistent."""

    code: ClassVar[str] = "ring_error"


class OversizedAllocation(RingError):
    """A request needs more staging bytes than the ring holds; it can never fit."""

    code: ClassVar[str] = "oversized_allocation"

    def __init__(self, size_bytes: int, capacity_bytes: int, owner: str) -> None:
        needed_mib = -(-size_bytes // (1 << 20))  # rounded up: a pool of this size fits it
        super().__init__(
            f"{owner!r} needs {size_bytes} staging bytes but the ring holds only "
            f"{capacity_bytes} ({capacity_bytes / (1 << 20):.1f} MiB). Raise the staging "
            f"pool (decodePoolMiB) to at least {needed_mib} MiB, or send smaller chunks."
        )
        self.size_bytes = size_bytes
        self.needed_bytes = size_bytes
        self.needed_mib = needed_mib
        self.capacity_bytes = capacity_bytes
        self.owner = owner


class TransportError(TransferError):
    """The transport (NIXL or loopback) refused or failed an operation."""

    code: ClassVar[str] = "transport_error"


class PeerUnreachable(TransportError):
    """The peer is unknown, was removed, or its process/connection is gone.

    Not retryable against the same peer incarnation: fail the requests bound to it,
    ``remove_peer`` it, and reconnect only with fresh metadata.
    """

    code: ClassVar[str] = "peer_unreachable"

    def __init__(self, peer: str, detail: str) -> None:
        super().__init__(f"peer {peer!r} is unreachable: {detail}")
        self.peer = peer


class RegistrationError(TransportError):
    """Memory registration or deregistration failed."""

    code: ClassVar[str] = "registration_failed"


class DescriptorError(TransportError):
    """A descriptor list is malformed (empty, mismatched lengths, mixed memory kinds)."""

    code: ClassVar[str] = "bad_descriptors"


class DescriptorOutOfBounds(DescriptorError):
    """A descriptor is not inside one registered region; nothing was posted.

    Guards docs/failure-modes.md #15: a peer can never make us read or write outside memory that
    was registered (locally) or granted (remotely).
    """

    code: ClassVar[str] = "descriptor_out_of_bounds"


class ProtocolError(TransferError):
    """The transfer protocol was broken, by us or by a peer."""

    code: ClassVar[str] = "protocol_error"


class LocalProtocolError(ProtocolError):
    """An illegal state transition was asked of a request; nothing changed (a local bug)."""

    code: ClassVar[str] = "local_protocol_error"


class RemoteProtocolError(ProtocolError):
    """A peer's message was rejected; ``reason`` is a stable snake_case metric label."""

    code: ClassVar[str] = "remote_protocol_error"

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"message rejected ({reason}): {detail}")
        self.reason = reason
        self.detail = detail


class BootstrapError(TransferError):
    """A peer's bootstrap document could not be fetched, parsed or used."""

    code: ClassVar[str] = "bootstrap_failed"


class GeometryMismatch(BootstrapError):
    """The peer's KV geometry (layers, heads, head dim, dtype, page size) differs from ours."""

    code: ClassVar[str] = "geometry_mismatch"
