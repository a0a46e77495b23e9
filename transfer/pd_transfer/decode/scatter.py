"""The device side of landing a staged part: scatters from the ring into the pool.

A request's destination pages go to the device once, when it starts (``dst_ids``). A
region's scatter is prepared (``prepare``: checked, its ids on the device, its kernel bound)
with a pre-grant, or when its StagedPart arrives; its launch is then O(1) host work
(``launch``). On CUDA it runs on the endpoint's staging stream and an event says when it
finished; on CPU the copy runs in the launch. No protocol here.
"""

from __future__ import annotations

import torch

from pd_transfer.decode.transfer import ReceiveTransfer, _InPart, _Writer
from pd_transfer.kv.pool import KVPool
from pd_transfer.kv.ring import Region
from pd_transfer.kv.staging import (
    PageIds,
    PreparedMove,
    StagingStream,
    prepare_pages,
    prepare_scatter,
)
from pd_transfer.protocol.parts import PartState

__all__: list[str] = []  # package-internal: DecodeReceiver composes it


class _Scatters:
    """One decode rank's scatters into ``pool`` (``stream``: the endpoint's staging stream
    on CUDA, None on CPU)."""

    def __init__(self, pool: KVPool, stream: StagingStream | None) -> None:
        self._pool = pool
        self._stream = stream

    def prepare(
        self, transfer: ReceiveTransfer, writer: _Writer, region: Region, layers: range,
        pages: range, *, ring_buffer: torch.Tensor,
    ) -> PreparedMove:
        """The scatter of ``region`` of ``ring_buffer`` (``layers`` in the plan's numbering ×
        ``pages`` of the request) into the pool, checked, its ids on the device and its
        kernel bound: the launch is then O(1) host work. A pre-grant's is prepared with the
        grant."""
        plan = writer.plan
        first = plan.dst_layer_start - plan.layers.start
        view = ring_buffer[region.offset_bytes : region.offset_bytes + region.size_bytes]
        return prepare_scatter(view, self._pool,
                               range(layers.start + first, layers.stop + first),
                               self.dst_ids(transfer).select(pages.start, pages.stop),
                               head_start=plan.heads.dst_head_offset,
                               num_heads=plan.heads.num_heads)

    def dst_ids(self, transfer: ReceiveTransfer) -> PageIds:
        """The request's destination pages on the pool's device, made once (when the
        request starts). CUDA: the scatters' stream is then ordered after everything the
        engine queued on its default stream so far, which includes the last kernels of
        these pages' previous owners; once per request, since the engine queues nothing on
        the pages while they load."""
        if transfer.dst_ids is None:
            transfer.dst_ids = prepare_pages(self._pool, transfer.dst_pages)
            if self._stream is not None:
                self._stream.order()
        return transfer.dst_ids

    def launch(self, part: _InPart, move: PreparedMove) -> bool:
        """Launch ``part``'s scatter; True if it already ran (CPU: the copy ran in the
        launch), else ``part.scattered`` fires when it has (CUDA)."""
        move.launch(None if self._stream is None else self._stream.stream)
        if self._stream is not None:
            part.scattered = self._stream.record()
        return self._stream is None

    @staticmethod
    def finished(part: _InPart) -> bool:
        """``part``'s scatter (on the stream) has finished."""
        event = part.scattered
        return event is not None and event.query()  # type: ignore[no-untyped-call]

    @staticmethod
    def wait(transfer: ReceiveTransfer) -> None:
        """Wait for the scatters ``transfer``'s parts still run (their regions are about to
        be freed): these events, not the device."""
        for writer in transfer.writers.values():
            for part in writer.in_state(PartState.SCATTERING):
                if part.scattered is not None:
                    part.scattered.synchronize()
