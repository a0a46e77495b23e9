"""A prefill rank's staging buffer: the registered memory parts are gathered into
(``StagingMemory``) and the ``StagingRing`` that hands out its space. ``swap`` replaces
both when a resize (``Endpoint.resize``) has drained it.
"""

from __future__ import annotations

import torch

from pd_transfer.endpoint import StagingMemory
from pd_transfer.kv.ring import Region, StagingRing
from pd_transfer.kv.staging import StagingStream
from pd_transfer.transport.base import RegisteredRegion, Transport

__all__ = ["StagingBuffer"]


class StagingBuffer:
    """The staging memory in force; every holder reads it through this object, so a swap
    is seen everywhere at once."""

    def __init__(self, transport: Transport, device: torch.device, size_bytes: int,
                 stream: StagingStream | None) -> None:
        """``stream``: the endpoint's staging stream on CUDA (gathers run on it), else None."""
        self._memory = StagingMemory(transport, device, size_bytes, label="staging",
                                     stream=stream)
        self.ring = StagingRing(size_bytes)

    @property
    def region(self) -> RegisteredRegion:
        return self._memory.region

    @property
    def version(self) -> int:
        return self._memory.version

    def view(self, region: Region, size_bytes: int) -> torch.Tensor:
        """The first ``size_bytes`` of ``region``, as bytes of the buffer."""
        return self._memory.view(region.offset_bytes, size_bytes)

    def swap(self, new_bytes: int) -> None:
        """Register a new buffer of ``new_bytes`` in place of the drained one; on an error
        the old one stays registered and in force."""
        self._memory.swap(new_bytes)  # nothing can land in the old buffer: it goes
        self.ring = StagingRing(new_bytes)
