"""The connector's worker side on a prefill TP rank (``kv_producer``): its ``PrefillSender``
and the layer groups each chunk is posted in (the shared flow is in ``rank``).

``begin_step`` registers a request on its first chunk (and connects to its decode pod off
the forward thread: decode's RequestKV is refused until this rank knows decode, and decode
re-sends it), appends the blocks a later chunk gained, and lays the chunk's completed pages
out over layer groups (``pipeline.compute_layer_groups``: one group for short chunks, the
plain path). ``layer_saved`` posts the groups ending at that layer, behind an event
recorded on the current stream (CUDA), while the next layers compute; ``end_step`` posts
what no layer hook posted. A request is reported in ``finished_sending`` once its transfer
ended and vLLM finished it (its blocks are held until then).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch

from pd_contract.config import LayerPipelineConfig
from pd_transfer.kv.pipeline import compute_layer_groups, record_ready_event
from pd_transfer.prefill import DecodeBinding, PrefillSender
from pd_transfer.protocol.lifecycle import RequestStatus
from pd_transfer.rank.pod_peers import PodConnections
from pd_transfer.vllm.rank import RankSide, Tracked, TransferResults
from pd_transfer.vllm.steps import PrefillChunk, StepPlan
from pd_transfer.vllm.timeline import Timeline

__all__ = ["PrefillRankSide"]


@dataclass(frozen=True)
class _Part:
    room: str
    pages: range
    layers: range | None  # None: every layer (the plain path)
    last: bool


class PrefillRankSide(RankSide[PrefillSender]):
    """A prefill TP rank's transfer state (the module docstring)."""

    def __init__(
        self,
        endpoint: PrefillSender,
        connections: PodConnections,
        layer_names: Iterable[str],
        pipeline: LayerPipelineConfig,
        *,
        device: torch.device,
        clock: Callable[[], float] = time.monotonic,
        timeline: Timeline | None = None,
    ) -> None:
        """``layer_names``: the attention layers in forward order (``save_kv_layer``'s
        names); ``device``: where the forward runs (its current stream orders the posts)."""
        super().__init__(endpoint, connections, clock=clock, timeline=timeline)
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.num_layers = len(self.layer_index)
        self.pipeline = pipeline
        self.device = device
        self._step_parts: dict[int, list[_Part]] = {}  # last layer of a group -> parts
        self._step_rooms: list[str] = []

    def _plan(self, plan: StepPlan) -> None:
        for chunk in plan.chunks:
            self._contained(chunk.room, partial(self._begin_chunk, chunk))
        self._step_rooms = [chunk.room for chunk in plan.chunks]

    def _begin_chunk(self, chunk: PrefillChunk) -> None:
        sender = self.endpoint
        if chunk.req_id not in self._tracked:
            self._track(chunk.req_id, chunk.room)
            self._watch(sender.register_request(
                chunk.room, chunk.new_pages, chunk.num_prompt_tokens,
                decode_instance=DecodeBinding.LATER), chunk.room)
            # Decode's RequestKV is refused until this rank knows decode (decode re-sends
            # it), then waits until the request is bound to the instance at the address the
            # router gave (docs/failure-modes.md #60).
            room = chunk.room
            self._connect(chunk.decode, "decode", room, lambda instance: self._watch(
                sender.bind_request(room, instance), room))
        elif chunk.new_pages:
            self._watch(sender.extend_request(chunk.room, chunk.new_pages), chunk.room)
        if chunk.page_stop <= chunk.page_start:
            return  # a partial page waits for the chunk that completes it
        pages = range(chunk.page_start, chunk.page_stop)
        groups = compute_layer_groups(self.num_layers, chunk.num_tokens, self.pipeline)
        plain = len(groups) == 1
        for index, group in enumerate(groups):
            part = _Part(chunk.room, pages, None if plain else group,
                         chunk.last and index == len(groups) - 1)
            self._step_parts.setdefault(group.stop - 1, []).append(part)

    def layer_saved(self, layer_name: str) -> None:
        """``save_kv_layer``: post the groups that end at this layer."""
        if not self._step_parts:
            return
        layer = self.layer_index.get(layer_name)
        parts = self._step_parts.pop(layer, None) if layer is not None else None
        if parts:
            self._post(parts)

    def end_step(self) -> None:
        """``wait_for_save``: post what no layer hook posted (in layer order)."""
        for layer in sorted(self._step_parts):
            self._post(self._step_parts.pop(layer))
        if self.timeline is not None and self._step_rooms:
            self.timeline.record("forward_end", *self._step_rooms, t=self.clock())
        self._step_rooms = []

    def _post(self, parts: list[_Part]) -> None:
        event = record_ready_event(self.device)
        now = self.clock()
        for part in parts:
            tracked = self._tracked.get(self._by_room.get(part.room, ""))
            if tracked is None or tracked.aborted:
                continue
            if self.timeline is not None:
                self.timeline.record(
                    "post", part.room, t=now, pages=[part.pages.start, part.pages.stop],
                    layers=None if part.layers is None else [part.layers.start,
                                                             part.layers.stop],
                    last=part.last)
            self._watch(self.endpoint.send_part(part.room, part.pages, part.layers,
                                                last=part.last, ready_event=event),
                        part.room)

    def _report(self, req_id: str, tracked: Tracked, status: RequestStatus | None,
                out: TransferResults) -> bool:
        return self._report_sent(req_id, out)

    def _abort_frees(self, tracked: Tracked) -> bool:
        return True  # an aborted send is reported as a send, its blocks freed
