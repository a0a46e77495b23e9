"""The connector's worker side on one TP rank: its sender or receiver, peers, layer groups
and completions.

Per engine step, in vLLM's order:

1. ``begin_step`` (``bind_connector_metadata``, before the forward): aborts; on prefill,
   register the request (first chunk) or append the blocks it gained, and lay the chunk's
   pages out over layer groups (``pipeline.compute_layer_groups``: one group for short
   chunks, the plain path);
2. ``layer_saved`` (``save_kv_layer``, after each attention layer): the groups ending at
   that layer are handed to the sender, which posts them off the forward thread while
   the next layers compute (on CUDA behind an event recorded on the current stream);
3. ``start_loads`` (``start_load_kv``, after the forward for asynchronous loads): on
   decode, ``expect`` the pages each new load lacks;
4. ``end_step`` (``wait_for_save``): posts any group whose last layer did not report
   (a layer skipped by the engine must not leave a request without its final part);
5. ``results`` (``get_transfer_results``): requests whose transfer ended.

Nothing here blocks the forward: sender/receiver calls return at once (a Future on the
transfer worker thread), and connecting to a peer pod the first time (an HTTP fetch of
its rank documents, then NIXL metadata) runs on a small thread pool; a request whose peer
cannot be reached fails alone. No exception of one request escapes into vLLM, whose
engine would die of it.

Empty steps: while requests only wait for transfers, vLLM steps without a forward as fast
as it can, and its processes' busy polling then starves every other process on the host
(on a 2-core machine a prefill engine beside such a decode engine made no progress for
30 s). On such a step ``results`` waits up to ``IDLE_WAIT_S`` for a transfer to end
before returning, so a waiting engine sleeps instead of spinning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Final

import torch

from pd_contract.config import LayerPipelineConfig
from pd_transfer.decode import DecodeReceiver
from pd_transfer.kv.pipeline import compute_layer_groups, record_ready_event
from pd_transfer.prefill import PrefillSender
from pd_transfer.protocol.lifecycle import FailureReason, RequestStatus, State
from pd_transfer.rank.pod_peers import PodConnections
from pd_transfer.vllm.steps import DecodeLoad, PrefillChunk, StepPlan
from pd_transfer.vllm.timeline import Timeline

__all__ = ["IDLE_WAIT_S", "RankSide", "TransferResults"]

log = logging.getLogger(__name__)

IDLE_WAIT_S: Final = 0.02
_IDLE_POLL_S: Final = 0.001
_CONNECT_THREADS: Final = 4


@dataclass
class TransferResults:
    """What ``get_transfer_results`` reports for one step."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _Part:
    room: str
    pages: range
    layers: range | None  # None: every layer (the plain path)
    last: bool


@dataclass
class _Tracked:
    """A request this rank sends or receives for, until vLLM has been told it ended."""

    room: str
    pages: tuple[int, ...] = ()
    aborted: bool = False
    failure: str | None = None  # failed before the endpoint knew it (peer unreachable)
    failure_reason: FailureReason | None = None  # why, as the endpoint would have said


class RankSide:
    """One TP rank's transfer state; its step methods run on vLLM's worker thread."""

    def __init__(
        self,
        endpoint: PrefillSender | DecodeReceiver,
        connections: PodConnections,
        layer_names: Iterable[str],
        pipeline: LayerPipelineConfig,
        *,
        device: torch.device,
        clock: Callable[[], float] = time.monotonic,
        timeline: Timeline | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.connections = connections
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.num_layers = len(self.layer_index)
        self.pipeline = pipeline
        self.device = device
        self.clock = clock
        self.timeline = timeline
        self._connect_pool = ThreadPoolExecutor(_CONNECT_THREADS, "pd-transfer-connect")
        self._tracked: dict[str, _Tracked] = {}  # by vLLM request id
        self._by_room: dict[str, str] = {}
        self._step_parts: dict[int, list[_Part]] = {}  # last layer of a group -> parts
        self._step_rooms: list[str] = []
        self._loads: list[DecodeLoad] = []
        self._forward = True
        self._finished: set[str] = set()  # vLLM finished these (their blocks are held)
        self._load_errors: set[int] = set()

    @property
    def is_prefill(self) -> bool:
        return isinstance(self.endpoint, PrefillSender)

    # Steps ---------------------------------------------------------------------------------

    def begin_step(self, plan: StepPlan) -> None:
        self._forward = plan.forward
        for room in plan.aborts:
            self._abort(room, "the engine ended the request")
        if self.is_prefill:
            for chunk in plan.chunks:
                self._contained(chunk.room, partial(self._begin_chunk, chunk))
            self._step_rooms = [chunk.room for chunk in plan.chunks]
        self._loads.extend(plan.loads)

    def _begin_chunk(self, chunk: PrefillChunk) -> None:
        sender = self.endpoint
        assert isinstance(sender, PrefillSender)
        if chunk.req_id not in self._tracked:
            self._track(chunk.req_id, chunk.room)
            self._watch(sender.register_request(chunk.room, chunk.new_pages,
                                                chunk.num_prompt_tokens), chunk.room)
            # Decode's RequestKV is refused until this rank knows decode; decode re-sends it.
            self._connect(chunk.decode, "decode", chunk.room, None)
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
        sender = self.endpoint
        assert isinstance(sender, PrefillSender)
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
            self._watch(sender.send_part(part.room, part.pages, part.layers, last=part.last,
                                         ready_event=event), part.room)

    def start_loads(self) -> None:
        """``start_load_kv``: ask prefill for every load planned this step."""
        loads, self._loads = self._loads, []
        for load in loads:
            tracked = self._track(load.req_id, load.room)
            tracked.pages = load.page_ids
            if load.error is not None:
                tracked.failure, tracked.failure_reason = load.error, FailureReason.INTERNAL_ERROR
                continue
            if self.timeline is not None:
                self.timeline.record("load_start", load.room, t=self.clock(),
                                     pages=len(load.page_ids), first_page=load.first_page)
            self._connect(load.prefill, "prefill", load.room, partial(self._expect, load))

    def _expect(self, load: DecodeLoad, instance: str) -> None:
        receiver = self.endpoint
        assert isinstance(receiver, DecodeReceiver)
        self._watch(receiver.expect(load.room, load.page_ids, load.num_prompt_tokens,
                                    first_page=load.first_page, prefill_instance=instance),
                    load.room)

    # Completions ---------------------------------------------------------------------------

    def results(self, finished_req_ids: Iterable[str]) -> TransferResults:
        """Requests whose transfer ended. Prefill reports a request only once vLLM finished
        it (its blocks are held until then); an aborted decode load frees like a send."""
        self._finished.update(finished_req_ids)
        out = self._collect()
        if not self._forward and self._tracked and not _any(out):
            deadline = self.clock() + IDLE_WAIT_S
            while not _any(out) and self.clock() < deadline:
                time.sleep(_IDLE_POLL_S)
                out = self._collect()
        return out

    def _collect(self) -> TransferResults:
        out = TransferResults()
        for req_id, tracked in list(self._tracked.items()):
            status = self.endpoint.poll(tracked.room)
            failed = tracked.failure is not None
            if not failed and (status is None or not status.finished):
                continue
            if self.is_prefill or tracked.aborted:
                if req_id not in self._finished:
                    continue
                out.finished_sending.add(req_id)
            else:
                out.finished_recving.add(req_id)
                if failed or (status is not None and status.state is State.FAILED):
                    out.failed_recving.add(req_id)
                    self._load_errors.update(tracked.pages)
                    log.warning("room %s: KV load failed: %s", tracked.room,
                                tracked.failure or _describe(status))
            if self.timeline is not None:
                # The rank's own cause first: the endpoint only saw the abort it led to.
                reason = tracked.failure_reason or (
                    status.reason if status is not None and status.finished else None)
                self.timeline.record(
                    "end", tracked.room, t=self.clock(),
                    state="Failed" if failed or status is None else status.state.value,
                    reason=None if reason is None else reason.value,
                    bytes=status.bytes_transferred if status is not None else 0,
                    duration_s=status.duration_s if status is not None else 0.0)
            self._forget(req_id, tracked)
        return out

    def load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (``get_block_ids_with_load_errors``)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def live_requests(self) -> int:
        return len(self._tracked)

    def statuses(self) -> Mapping[str, RequestStatus | None]:
        return {t.room: self.endpoint.poll(t.room) for t in self._tracked.values()}

    def close(self) -> None:
        self._connect_pool.shutdown(wait=False, cancel_futures=True)

    # Internals -----------------------------------------------------------------------------

    def _track(self, req_id: str, room: str) -> _Tracked:
        tracked = _Tracked(room)
        self._tracked[req_id] = tracked
        self._by_room[room] = req_id
        return tracked

    def _forget(self, req_id: str, tracked: _Tracked) -> None:
        del self._tracked[req_id]
        self._by_room.pop(tracked.room, None)
        self._finished.discard(req_id)
        self.endpoint.forget(tracked.room)

    def _fail(self, room: str, detail: str, reason: FailureReason) -> None:
        """A request failed before (or outside) its transfer: abort it on the endpoint and
        remember why, so ``results`` reports it even if the endpoint never knew it."""
        req_id = self._by_room.get(room)
        if req_id is not None:
            tracked = self._tracked[req_id]
            tracked.failure, tracked.failure_reason = detail, reason
        self._abort(room, detail)

    def _abort(self, room: str, detail: str) -> None:
        req_id = self._by_room.get(room)
        if req_id is not None:
            self._tracked[req_id].aborted = self.is_prefill or (
                self._tracked[req_id].failure is None)
        self._watch(self.endpoint.abort(room, detail), room)

    def _connect(self, address: str, role: str, room: str,
                 then: Callable[[str], None] | None) -> None:
        """Connect to the pod at ``address`` off the forward thread, then ``then(instance)``;
        a pod that cannot be reached fails ``room``."""
        def run() -> None:
            try:
                docs = self.connections.connect(address, role)
            except Exception as exc:  # whatever it was, this request fails alone
                self._fail(room, f"{role} pod {address}: {exc}",
                           FailureReason.PEER_UNREACHABLE)
                return
            if then is not None:
                self._contained(room, partial(then, docs[0].instance))

        self._connect_pool.submit(run)

    def _contained(self, room: str, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception as exc:  # one request's error must not kill the engine
            log.exception("room %s: %s", room, exc)
            self._fail(room, f"{type(exc).__name__}: {exc}", FailureReason.INTERNAL_ERROR)

    @staticmethod
    def _watch(future: Future[None], room: str) -> None:
        def done(f: Future[None]) -> None:
            exc = f.exception()
            if exc is not None:
                log.warning("room %s: %s", room, exc)

        future.add_done_callback(done)


def _any(results: TransferResults) -> bool:
    return bool(results.finished_sending or results.finished_recving)


def _describe(status: RequestStatus | None) -> str:
    if status is None:
        return "no status"
    reason = status.reason.value if status.reason is not None else status.state.value
    return f"{reason}: {status.detail}"
