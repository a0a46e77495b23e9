"""What the scheduler side tells the workers each step (vLLM pickles it to every TP worker).

Plain frozen dataclasses: they cross a process boundary every engine step, so they carry
ids and ranges only, never tensors or handles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DecodeLoad", "PrefillChunk", "StepPlan"]


@dataclass(frozen=True)
class PrefillChunk:
    """A prefill request's work in one step: it computes prompt tokens
    ``[token_start, token_stop)`` into blocks it now holds, then sends the request pages
    ``[page_start, page_stop)`` that this chunk completed (the final chunk also sends the
    trailing partial page). ``new_pages`` are the block ids the request gained this step,
    appended to its page table; the first chunk's also hold any prefix prefill had cached."""

    req_id: str
    room: str
    decode: str
    num_prompt_tokens: int
    token_start: int
    token_stop: int
    page_start: int
    page_stop: int
    new_pages: tuple[int, ...]

    @property
    def last(self) -> bool:
        return self.token_stop == self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.token_stop - self.token_start


@dataclass(frozen=True)
class DecodeLoad:
    """A decode request waits for its prompt's KV: request pages ``[first_page, ...)`` go
    into ``page_ids`` (decode's own prefix cache holds the pages before ``first_page``)."""

    req_id: str
    room: str
    prefill: str
    num_prompt_tokens: int
    first_page: int
    page_ids: tuple[int, ...]
    error: str | None = None  # the load cannot start: the worker reports it failed at once


@dataclass(frozen=True)
class StepPlan:
    """One step's connector metadata: prefill chunks, decode loads, rooms to abort, and
    whether the step runs a forward at all (``forward``: False for the empty steps vLLM
    takes while requests only wait for their transfers)."""

    chunks: tuple[PrefillChunk, ...] = ()
    loads: tuple[DecodeLoad, ...] = ()
    aborts: tuple[str, ...] = field(default=())
    forward: bool = True
