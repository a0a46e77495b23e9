"""``StagingMemory``: one rank's staging memory, whichever side it serves.

Decode's ring and prefill's staging buffer are the same thing to the transport: a device
buffer registered under ``<agent>/<label>`` (then ``<label>-v<N>`` after each resize) with a
registration version that starts at 1. ``swap`` replaces buffer and registration once the
side has drained it, keeping the old one registered and in force if the new registration
fails. What hands out the space (a ``StagingRing``) and who must hear of a swap stay with the
side (``prefill/buffer.py``, ``decode/receiver.py``).
"""

from __future__ import annotations

import torch

from pd_transfer.kv.staging import StagingStream
from pd_transfer.transport.base import RegisteredRegion, Transport

__all__ = ["StagingMemory"]


class StagingMemory:
    def __init__(self, transport: Transport, device: torch.device, size_bytes: int, *,
                 label: str, stream: StagingStream | None) -> None:
        """``stream``: the endpoint's staging stream on CUDA (its gathers or scatters read
        and write this memory), else None."""
        self._transport = transport
        self._device = device
        self._label = label
        self._stream = stream
        self.memory = torch.zeros(size_bytes, dtype=torch.uint8, device=device)
        self.region: RegisteredRegion = transport.register(
            self.memory, name=f"{transport.agent_name}/{label}")
        self.version = 1

    def view(self, offset_bytes: int, size_bytes: int) -> torch.Tensor:
        """``size_bytes`` of the memory from ``offset_bytes``."""
        return self.memory[offset_bytes : offset_bytes + size_bytes]

    def swap(self, new_bytes: int) -> torch.Tensor:
        """Register new memory of ``new_bytes`` in place of the drained one and bump the
        version; returns the old memory (a peer's late WRITE may still land in it: decode
        keeps it while a quarantined region pins it). On an error the old memory stays
        registered and in force, and the version is unchanged."""
        if self._stream is not None:
            # A gather or scatter of a request failed at the deadline may still be queued:
            # the old memory must not go back to the allocator under it.
            self._stream.stream.synchronize()
        # Uninitialised: every region is written before it is read, and a zero-fill would
        # be a kernel that a peer's WRITE into the new memory does not wait for.
        new_memory = torch.empty(new_bytes, dtype=torch.uint8, device=self._device)
        old_memory, old_region = self.memory, self.region
        self._transport.deregister(old_region)
        try:
            region = self._transport.register(
                new_memory, name=f"{self._transport.agent_name}/{self._label}-v"
                                 f"{self.version + 1}")
        except Exception:
            self.region = self._transport.register(old_memory, name=old_region.name)
            raise
        self.memory, self.region = new_memory, region
        self.version += 1
        return old_memory
