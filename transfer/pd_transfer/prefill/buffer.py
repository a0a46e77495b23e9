"""A prefill rank's staging buffer: the device memory parts are gathered into, its
registration with the transport, the ``StagingRing`` that hands out its space and its
registration version. ``swap`` replaces all four when ``resize_buffer`` has drained it.
"""

from __future__ import annotations

import torch

from pd_transfer.ring import Region, StagingRing
from pd_transfer.staging import StagingStream
from pd_transfer.transport.base import RegisteredRegion, Transport

__all__ = ["StagingBuffer"]


class StagingBuffer:
    """The staging memory in force; every holder reads it through this object, so a swap
    is seen everywhere at once."""

    def __init__(self, transport: Transport, device: torch.device, size_bytes: int,
                 stream: StagingStream | None) -> None:
        """``stream``: the endpoint's staging stream on CUDA (gathers run on it), else None."""
        self._transport = transport
        self._device = device
        self._stream = stream
        self.memory = torch.zeros(size_bytes, dtype=torch.uint8, device=device)
        self.region: RegisteredRegion = transport.register(
            self.memory, name=f"{transport.agent_name}/staging"
        )
        self.ring = StagingRing(size_bytes)
        self.version = 1

    def view(self, region: Region, size_bytes: int) -> torch.Tensor:
        """The first ``size_bytes`` of ``region``, as bytes of the buffer."""
        return self.memory[region.offset_bytes : region.offset_bytes + size_bytes]

    def swap(self, new_bytes: int) -> None:
        """Register a new buffer of ``new_bytes`` in place of the drained one; on an error
        the old one stays registered and in force."""
        # Uninitialised: every region is written before it is read, and a zero-fill would
        # be a kernel that a peer's WRITE into the new buffer does not wait for.
        if self._stream is not None:
            # A gather of a request failed at the deadline may still be queued: the old
            # buffer's memory must not go back to the allocator under it.
            self._stream.stream.synchronize()
        new_buffer = torch.empty(new_bytes, dtype=torch.uint8, device=self._device)
        old_buffer, old_region = self.memory, self.region
        self._transport.deregister(old_region)
        try:
            region = self._transport.register(
                new_buffer, name=f"{self._transport.agent_name}/staging-v{self.version + 1}")
        except Exception:
            self.region = self._transport.register(old_buffer, name=old_region.name)
            raise
        self.memory, self.region = new_buffer, region
        self.ring = StagingRing(new_bytes)
        self.version += 1
