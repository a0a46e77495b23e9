"""The connector's scheduler side: which requests send or load KV, and each step's plan.

Pure bookkeeping over ids and counts (``connector`` turns vLLM's objects into these calls),
so every decision here is unit-tested without an engine.

Prefill (``kv_producer``): a request carrying ``SendParams`` computes its prompt as usual;
each step that schedules prompt tokens for it yields a ``PrefillChunk`` naming the pages
the chunk completes. When vLLM finishes the request, its blocks stay held
(``request_finished`` → True) until the worker reports the transfer finished: decode
released it, or the lease ended, or it failed.

Decode (``kv_consumer``): a request carrying ``LoadParams`` reports every prompt token
beyond its local prefix-cache hit as loadable asynchronously; after vLLM allocated the
blocks, the next step's plan carries a ``DecodeLoad`` of the pages decode lacks. A request
that ends while its load is live (the client went away) keeps its blocks until the worker
saw the load end, so no late write lands in a reused block.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pd_transfer.agent.report import RequestCounts
from pd_transfer.protocol.handoff import read_load_params, read_send_params
from pd_transfer.vllm.steps import DecodeLoad, PrefillChunk, StepPlan

__all__ = ["ScheduledPrompt", "SchedulerSide"]

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class ScheduledPrompt:
    """One request scheduled this step: ``num_tokens`` tokens from ``token_start`` (its
    computed tokens before the step), and the block ids it gained (``new_pages``).
    ``resumed``: vLLM preempted it earlier and now recomputes it in fresh blocks."""

    req_id: str
    token_start: int
    num_tokens: int
    new_pages: tuple[int, ...]
    resumed: bool = False


class _LoadState(enum.Enum):
    MATCHED = "matched"    # told the scheduler the tokens load asynchronously
    LOADING = "loading"    # blocks allocated, the load is in this or an earlier plan
    ABORTING = "aborting"  # the request ended during its load; blocks held until it ends
    DONE = "done"


@dataclass
class _Send:
    room: str
    decode: str
    num_prompt_tokens: int
    next_page: int = 0
    registered: bool = False
    held: bool = False
    broken: bool = False  # preempted mid-transfer: its KV was recomputed elsewhere


@dataclass
class _Load:
    room: str
    prefill: str
    num_prompt_tokens: int
    computed: int = 0
    state: _LoadState = _LoadState.MATCHED


@dataclass
class _Pending:
    chunks: list[PrefillChunk] = field(default_factory=list)
    loads: list[DecodeLoad] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


class SchedulerSide:
    """The scheduler half of ``PDTransferConnector`` (one per engine)."""

    def __init__(self, role: Role, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.role = role
        self.page_size = page_size
        self._sends: dict[str, _Send] = {}
        self._loads: dict[str, _Load] = {}
        self._pending = _Pending()
        self._ended = 0  # requests vLLM ended, and those it ended with an error
        self._errors = 0

    # Requests ------------------------------------------------------------------------------

    def track(self, req_id: str, params: Mapping[str, Any] | None,
              num_prompt_tokens: int) -> None:
        """Note a request's transfer the first time the scheduler shows it (idempotent).
        Raises ParamsError for malformed ``kv_transfer_params``."""
        if req_id in self._sends or req_id in self._loads:
            return
        if self.role == "prefill":
            send = read_send_params(params)
            if send is not None:
                self._sends[req_id] = _Send(send.room, send.decode, num_prompt_tokens)
        else:
            load = read_load_params(params)
            if load is not None:
                self._loads[req_id] = _Load(load.room, load.prefill, num_prompt_tokens)

    def matched_tokens(self, req_id: str, num_computed_tokens: int) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: decode loads every prompt token past its local
        hit, asynchronously; nothing else is matched."""
        load = self._loads.get(req_id)
        if load is None or load.state is not _LoadState.MATCHED:
            return 0, False
        count = load.num_prompt_tokens - num_computed_tokens
        if count <= 0:
            load.state = _LoadState.DONE
            return 0, False
        load.computed = num_computed_tokens
        return count, True

    def after_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """``update_state_after_alloc``: the request's blocks exist; plan its load."""
        load = self._loads.get(req_id)
        if load is None or load.state is not _LoadState.MATCHED or num_external_tokens <= 0:
            return
        total_pages = -(-load.num_prompt_tokens // self.page_size)
        first_page = load.computed // self.page_size
        error = None
        if len(block_ids) < total_pages:  # vLLM broke its own contract: fail this load only
            error = (f"{len(block_ids)} blocks allocated for a {load.num_prompt_tokens}-token "
                     f"prompt that needs {total_pages}")
        load.state = _LoadState.LOADING
        self._pending.loads.append(DecodeLoad(
            req_id, load.room, load.prefill, load.num_prompt_tokens, first_page,
            tuple(int(b) for b in block_ids[first_page:total_pages]), error,
        ))

    def build(self, scheduled: Sequence[ScheduledPrompt]) -> StepPlan:
        """``build_connector_meta``: this step's chunks, loads and aborts; resets them."""
        if self.role == "prefill":
            for prompt in scheduled:
                self._plan_chunk(prompt)
        pending, self._pending = self._pending, _Pending()
        return StepPlan(tuple(pending.chunks), tuple(pending.loads), tuple(pending.aborts),
                        forward=any(prompt.num_tokens > 0 for prompt in scheduled))

    def _plan_chunk(self, prompt: ScheduledPrompt) -> None:
        send = self._sends.get(prompt.req_id)
        if send is None or send.broken:
            return
        if prompt.resumed and send.registered:
            # Preempted: vLLM freed the blocks the sender holds and recomputes the prompt
            # in new ones. The transfer cannot continue; decode learns it from the Abort.
            send.broken = True
            self._pending.aborts.append(send.room)
            return
        if prompt.token_start >= send.num_prompt_tokens:
            return  # a generation step: the prompt's KV is all sent
        stop = min(prompt.token_start + prompt.num_tokens, send.num_prompt_tokens)
        last = stop == send.num_prompt_tokens
        total_pages = -(-send.num_prompt_tokens // self.page_size)
        done_pages = total_pages if last else max(send.next_page, stop // self.page_size)
        self._pending.chunks.append(PrefillChunk(
            prompt.req_id, send.room, send.decode, send.num_prompt_tokens,
            prompt.token_start, stop, send.next_page, done_pages, prompt.new_pages,
        ))
        send.next_page = done_pages
        send.registered = True

    def finished(self, req_id: str, *, completed_prompt: bool, errored: bool = False) -> bool:
        """``request_finished`` (vLLM calls it for every request that ends): True keeps the
        request's blocks until the worker reports its transfer finished.
        ``completed_prompt``: vLLM computed the whole prompt (False when the request was
        aborted or failed before); ``errored``: vLLM ended it with an error (HTTP 500)."""
        self._ended += 1
        self._errors += errored
        send = self._sends.get(req_id)
        if send is not None:
            if not send.registered:
                del self._sends[req_id]
                return False
            if not completed_prompt and not send.broken:
                self._pending.aborts.append(send.room)
            send.held = True
            return True
        load = self._loads.get(req_id)
        if load is None:
            return False
        if load.state is _LoadState.LOADING:
            load.state = _LoadState.ABORTING
            self._pending.aborts.append(load.room)
            return True
        del self._loads[req_id]
        return False

    def transfers_done(self, finished_sending: Iterable[str],
                       finished_recving: Iterable[str]) -> None:
        """``update_connector_output``: the workers' completions of this step."""
        for req_id in finished_sending:
            self._sends.pop(req_id, None)
            load = self._loads.get(req_id)
            if load is not None and load.state is _LoadState.ABORTING:
                del self._loads[req_id]
        for req_id in finished_recving:
            load = self._loads.get(req_id)
            if load is None:
                continue
            if load.state is _LoadState.LOADING:
                load.state = _LoadState.DONE
            elif load.state is _LoadState.ABORTING:
                # The load ended in the step vLLM finished the request (a load failure under
                # the "fail" policy, or an abort racing the load's end): vLLM frees the
                # blocks on this report, and the worker has forgotten the room.
                del self._loads[req_id]

    def has_pending_sends(self) -> bool:
        """Whether finished prefill requests still hold blocks (the engine must keep
        stepping so the workers can report their transfers)."""
        return any(send.held for send in self._sends.values())

    def live_requests(self) -> int:
        """Requests with connector state (0 once every transfer has ended)."""
        return len(self._sends) + len(self._loads)

    def request_counts(self) -> RequestCounts:
        """The requests vLLM ended since it started, and those it ended with an error (read
        from the pod agent's threads: two int reads)."""
        return RequestCounts(self._ended, self._errors)
