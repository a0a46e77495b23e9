"""The connector's worker side on one TP rank, what its two halves share: the requests it
tracks, its peers, its completions. ``prefill_rank.PrefillRankSide`` (over a
``PrefillSender``) and ``decode_rank.DecodeRankSide`` (over a ``DecodeReceiver``) each own
their typed endpoint and do their role's share of a step; the connector opens the half of
its ``kv_role`` and then calls every hook on ``RankSide`` alone.

Per engine step, in vLLM's order:

1. ``begin_step`` (``bind_connector_metadata``, before the forward): aborts, then the
   half's share of the plan (prefill: register the request or append the blocks it
   gained, and lay the chunk's pages out over layer groups; decode: the loads to start);
2. ``layer_saved`` (``save_kv_layer``, after each attention layer): prefill posts the
   groups ending at that layer off the forward thread while the next layers compute;
3. ``start_loads`` (``start_load_kv``, after the forward for asynchronous loads): decode
   ``expect``s the pages each new load lacks;
4. ``end_step`` (``wait_for_save``): prefill posts any group whose last layer did not
   report (a layer skipped by the engine must not leave a request without its final part);
5. ``results`` (``get_transfer_results``): requests whose transfer ended.

A hook that is not its half's business does nothing. Nothing here blocks the forward:
sender/receiver calls return at once (a Future on the transfer worker thread), and
connecting to a peer pod the first time (an HTTP fetch of its rank documents, then NIXL
metadata) runs on a small thread pool; a request whose peer cannot be reached fails alone.
No exception of one request escapes into vLLM, whose engine would die of it.

Empty steps: while requests only wait for transfers, vLLM steps without a forward as fast
as it can, and its processes' busy polling then starves every other process on the host
(on a 2-core machine a prefill engine beside such a decode engine made no progress for
30 s). On such a step ``results`` waits up to ``IDLE_WAIT_S`` for a transfer to end
before returning, so a waiting engine sleeps instead of spinning.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, Generic, TypeVar

from pd_transfer.endpoint import Endpoint
from pd_transfer.protocol.lifecycle import FailureReason, RequestStatus
from pd_transfer.rank.pod_peers import PodConnections
from pd_transfer.vllm.steps import StepPlan
from pd_transfer.vllm.timeline import Timeline

__all__ = ["IDLE_WAIT_S", "RankSide", "Tracked", "TransferResults"]

log = logging.getLogger(__name__)

IDLE_WAIT_S: Final = 0.02
_IDLE_POLL_S: Final = 0.001
_CONNECT_THREADS: Final = 4

EndpointT = TypeVar("EndpointT", bound="Endpoint[Any]")


@dataclass
class TransferResults:
    """What ``get_transfer_results`` reports for one step."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


@dataclass
class Tracked:
    """A request this rank sends or receives for, until vLLM has been told it ended."""

    room: str
    pages: tuple[int, ...] = ()
    aborted: bool = False  # reported as a send (its blocks freed) once vLLM finished it
    failure: str | None = None  # failed before the endpoint knew it (peer unreachable)
    failure_reason: FailureReason | None = None  # why, as the endpoint would have said


class RankSide(abc.ABC, Generic[EndpointT]):
    """One TP rank's transfer state over its typed endpoint; its step methods run on vLLM's
    worker thread (the module docstring). A half implements ``_plan`` (its share of a step
    plan), ``_report`` (how an ended request is reported) and ``_abort_frees`` (whether an
    abort reports a request as a send)."""

    def __init__(self, endpoint: EndpointT, connections: PodConnections, *,
                 clock: Callable[[], float] = time.monotonic,
                 timeline: Timeline | None = None) -> None:
        self.endpoint = endpoint
        self.connections = connections
        self.clock = clock
        self.timeline = timeline
        self._connect_pool = ThreadPoolExecutor(_CONNECT_THREADS, "pd-transfer-connect")
        self._tracked: dict[str, Tracked] = {}  # by vLLM request id
        self._by_room: dict[str, str] = {}
        self._forward = True
        self._finished: set[str] = set()  # vLLM finished these (their blocks are held)

    # Steps ---------------------------------------------------------------------------------

    def begin_step(self, plan: StepPlan) -> None:
        """``bind_connector_metadata``: the step's aborts, then this half's share of it."""
        self._forward = plan.forward
        for room in plan.aborts:
            self._abort(room, "the engine ended the request")
        self._plan(plan)

    def layer_saved(self, layer_name: str) -> None:
        """``save_kv_layer``: nothing, unless the half posts per layer (prefill)."""

    def end_step(self) -> None:
        """``wait_for_save``: nothing, unless the half posts what is left (prefill)."""

    def start_loads(self) -> None:
        """``start_load_kv``: nothing, unless the half loads (decode)."""

    # Completions ---------------------------------------------------------------------------

    def results(self, finished_req_ids: Iterable[str]) -> TransferResults:
        """Requests whose transfer ended. A send is reported only once vLLM finished it (its
        blocks are held until then); an aborted decode load frees like a send."""
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
            if not self._report(req_id, tracked, status, out):
                continue
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

    def _report_sent(self, req_id: str, out: TransferResults) -> bool:
        """Report ``req_id`` in ``finished_sending`` once vLLM finished it; False: not yet."""
        if req_id not in self._finished:
            return False
        out.finished_sending.add(req_id)
        return True

    def load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (``get_block_ids_with_load_errors``);
        none unless the half loads (decode)."""
        return set()

    def live_requests(self) -> int:
        return len(self._tracked)

    def statuses(self) -> Mapping[str, RequestStatus | None]:
        return {t.room: self.endpoint.poll(t.room) for t in self._tracked.values()}

    def close(self) -> None:
        self._connect_pool.shutdown(wait=False, cancel_futures=True)

    # The halves' share -----------------------------------------------------------------------

    @abc.abstractmethod
    def _plan(self, plan: StepPlan) -> None:
        """This half's share of a step plan (after its aborts)."""

    @abc.abstractmethod
    def _report(self, req_id: str, tracked: Tracked, status: RequestStatus | None,
                out: TransferResults) -> bool:
        """Add ended request ``req_id`` to ``out``; False: not yet (it stays tracked)."""

    @abc.abstractmethod
    def _abort_frees(self, tracked: Tracked) -> bool:
        """Whether aborting ``tracked`` reports it as a send (``Tracked.aborted``)."""

    # Internals -----------------------------------------------------------------------------

    def _track(self, req_id: str, room: str) -> Tracked:
        tracked = Tracked(room)
        self._tracked[req_id] = tracked
        self._by_room[room] = req_id
        return tracked

    def _forget(self, req_id: str, tracked: Tracked) -> None:
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
            self._tracked[req_id].aborted = self._abort_frees(self._tracked[req_id])
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
