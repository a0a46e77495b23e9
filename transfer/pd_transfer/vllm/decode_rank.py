"""The connector's worker side on a decode TP rank (``kv_consumer``): its ``DecodeReceiver``
and the loads it starts (the shared flow is in ``rank``).

``begin_step`` keeps the step's loads; ``start_loads`` connects to each load's prefill pod
off the forward thread, then ``expect``s the pages the load lacks. A load ends in
``finished_recving`` (and ``failed_recving`` with its blocks in ``load_errors`` if it
failed, vLLM's load-error policy then deciding); a load the engine aborted frees its blocks
like a send (``finished_sending``) once vLLM finished it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

from pd_transfer.decode import DecodeReceiver
from pd_transfer.protocol.lifecycle import FailureReason, RequestStatus, State
from pd_transfer.rank.pod_peers import PodConnections
from pd_transfer.vllm.rank import RankSide, Tracked, TransferResults
from pd_transfer.vllm.steps import DecodeLoad, StepPlan
from pd_transfer.vllm.timeline import Timeline

__all__ = ["DecodeRankSide"]

log = logging.getLogger(__name__)


class DecodeRankSide(RankSide[DecodeReceiver]):
    """A decode TP rank's transfer state (the module docstring)."""

    def __init__(self, endpoint: DecodeReceiver, connections: PodConnections, *,
                 clock: Callable[[], float] = time.monotonic,
                 timeline: Timeline | None = None) -> None:
        super().__init__(endpoint, connections, clock=clock, timeline=timeline)
        self._loads: list[DecodeLoad] = []
        self._load_errors: set[int] = set()

    def _plan(self, plan: StepPlan) -> None:
        self._loads.extend(plan.loads)

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
        self._watch(self.endpoint.expect(load.room, load.page_ids, load.num_prompt_tokens,
                                         first_page=load.first_page,
                                         prefill_instance=instance), load.room)

    def _report(self, req_id: str, tracked: Tracked, status: RequestStatus | None,
                out: TransferResults) -> bool:
        if tracked.aborted:
            return self._report_sent(req_id, out)
        out.finished_recving.add(req_id)
        if tracked.failure is not None or (status is not None and status.state is State.FAILED):
            out.failed_recving.add(req_id)
            self._load_errors.update(tracked.pages)
            log.warning("room %s: KV load failed: %s", tracked.room,
                        tracked.failure or _describe(status))
        return True

    def _abort_frees(self, tracked: Tracked) -> bool:
        # An abort the engine asked for frees the blocks; one that a failure led to reports
        # the load failed (its blocks are load errors).
        return tracked.failure is None

    def load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (``get_block_ids_with_load_errors``)."""
        errors, self._load_errors = self._load_errors, set()
        return errors


def _describe(status: RequestStatus | None) -> str:
    if status is None:
        return "no status"
    reason = status.reason.value if status.reason is not None else status.state.value
    return f"{reason}: {status.detail}"
