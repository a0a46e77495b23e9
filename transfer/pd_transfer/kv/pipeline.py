"""The layer pipeline: which layer groups a prefill forward is split into, and the driver that
posts each group's KV while the next group computes.

Why: without it decode receives nothing until the whole forward is done, so the KV-ready
latency is ``C + T`` (compute, then transfer). Posting layer group ``g`` while group ``g+1``
computes overlaps the two; only the last group's transfer (or compute) stays exposed, so the
latency falls towards ``max(C, T) + min(C, T) / N`` for ``N`` groups.

Group count (``compute_layer_groups``), for ``L`` layers and a chunk of ``n`` tokens:

1. Plain path: the pipeline is disabled, or ``n < min_tokens`` → ONE group, all layers.
   The driver then runs the forward once, records at most one ready event (GPU only: the
   same event compute-then-transfer needs) and posts one part: no added work (docs/failure-modes.md
   #17:
   a public layer pipeline was 18% slower at 256 tokens because short prompts paid for it).
2. Fixed: ``group_size`` is set → groups of ``group_size`` layers (the last one shorter when
   ``L`` is not a multiple), no progressive first group: a fixed size is a fixed size.
3. Adaptive, between ``min_groups`` and ``max_groups``, falling with the log of the length::

       t = clamp(log2(n / min_tokens) / log2(saturation), 0, 1)   (t = 1 if saturation == 1)
       N = min(L, floor(max_groups - t * (max_groups - min_groups) + 0.5))

   Why falling: just above ``min_tokens`` compute and transfer both grow linearly with
   ``n`` and are of the same order, so the exposed tail ``min(C, T) / N`` is a large share
   of the latency and only many groups hide it. As ``n`` grows, attention's quadratic
   compute dominates, ``T / C`` shrinks, and a few groups already hide the tail; more
   groups would then only add per-part costs (an event, a post and a notification per
   group and per prefill chunk, ring grants on the staged path).

   Progressive first group: the first group is half the size of the others, so decode
   starts receiving after half a group's compute. With weights 1 for the first group and
   2 for each other one: ``first = max(1, floor(L / (2N - 1)))``; the other ``L - first``
   layers split into ``N - 1`` groups of ``q = (L - first) // (N - 1)`` layers, the first
   ``(L - first) % (N - 1)`` of them one layer larger (the smallest groups come last, so
   the exposed tail is short too).

Worked example: ``L = 32``, ``min_tokens = 512``, ``min_groups = 2``, ``max_groups = 8``,
``saturation = 16``:

- ``n = 256``: below ``min_tokens`` → ``(range(0, 32),)``.
- ``n = 512``: ``t = 0``, ``N = 8``; ``first = floor(32 / 15) = 2``; 30 layers over 7
  groups: ``q = 4``, remainder 2 → sizes ``2, 5, 5, 4, 4, 4, 4, 4``.
- ``n = 2048``: ``t = log2 4 / log2 16 = 0.5``, ``N = floor(8 - 3 + 0.5) = 5``;
  ``first = floor(32 / 9) = 3``; 29 over 4: ``q = 7``, remainder 1 → ``3, 8, 7, 7, 7``.
- ``n >= 8192``: ``t = 1``, ``N = 2``; ``first = floor(32 / 3) = 10`` → ``10, 22``.

Chunked prefill and prefix hits (``compute_chunk_plan``): each chunk sends the pages it
completed (a trailing partial page waits for the chunk that fills it, or for the final
chunk), skipping the pages decode already holds (the sender then holds only the others).
Groups are computed per chunk from the tokens that chunk computes, so a prompt's parts are
chunk × layer group; only the final part of the final chunk carries ``last=True`` and
completes the request on decode.

``LayerPipeline`` is the driver. It does no transfer itself: it hands parts to a
``PartSink`` (the prefill sender) whose ``send_part`` must not block on the data: it
waits for the part's ready event off the engine's thread (``event.query()`` polling, never
a device-wide sync), so the next group's kernels are already queued when group ``g``'s
transfer starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pd_contract.config import LayerPipelineConfig

__all__ = [
    "ChunkPlan",
    "ChunkRun",
    "GroupForward",
    "LayerPipeline",
    "PartSink",
    "compute_chunk_plan",
    "compute_group_count",
    "compute_layer_groups",
    "record_ready_event",
]


def record_ready_event(device: torch.device) -> torch.cuda.Event | None:
    """The event a part's send waits on: recorded on ``device``'s current stream, where the
    engine just wrote the part's KV. None on CPU, where the KV is in place once written."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


def compute_group_count(num_layers: int, num_tokens: int, config: LayerPipelineConfig) -> int:
    """How many adaptive groups a chunk of ``num_tokens`` gets (module docstring, rule 3),
    ignoring the plain-path threshold and ``group_size``; at most ``num_layers``."""
    if config.min_groups > config.max_groups:
        raise ValueError(
            f"layer pipeline: min_groups ({config.min_groups}) exceeds max_groups "
            f"({config.max_groups}); set min_groups <= max_groups"
        )
    if config.saturation == 1.0:
        fraction = 1.0
    else:
        ratio = max(num_tokens, 1) / config.min_tokens
        # log2: exact for power-of-two ratios, so the documented examples hold to the bit.
        fraction = min(1.0, max(0.0, math.log2(ratio) / math.log2(config.saturation)))
    span = config.max_groups - config.min_groups
    return min(num_layers, math.floor(config.max_groups - fraction * span + 0.5))


def compute_layer_groups(
    num_layers: int, num_tokens: int, config: LayerPipelineConfig
) -> tuple[range, ...]:
    """The layer groups, in forward order, for a chunk of ``num_tokens`` (module docstring).

    The groups are consecutive, non-empty, and cover ``range(num_layers)`` exactly once.
    """
    if num_layers <= 0:
        raise ValueError(f"layer pipeline: num_layers must be positive, got {num_layers}")
    if not config.enabled or num_tokens < config.min_tokens:
        return (range(num_layers),)
    if config.group_size is not None:
        size = config.group_size
        return tuple(range(s, min(s + size, num_layers)) for s in range(0, num_layers, size))
    count = compute_group_count(num_layers, num_tokens, config)
    if count <= 1:
        return (range(num_layers),)
    first = max(1, num_layers // (2 * count - 1))
    rest, others = num_layers - first, count - 1
    size, extra = divmod(rest, others)
    sizes = [first] + [size + 1 if i < extra else size for i in range(others)]
    groups: list[range] = []
    start = 0
    for group_size in sizes:
        groups.append(range(start, start + group_size))
        start += group_size
    return tuple(groups)


@dataclass(frozen=True)
class ChunkPlan:
    """One prefill chunk: it computes tokens ``[token_start, token_stop)``, then sends the
    request's pages ``request_pages`` (indices into the request's page table). ``part_pages``
    are the same pages as indices into the pages the sender holds for decode, which start
    after decode's cached prefix (``PrefillSender.send_part`` takes these). ``last`` marks
    the final chunk, whose final part completes the request."""

    token_start: int
    token_stop: int
    request_pages: range
    part_pages: range
    last: bool

    @property
    def num_tokens(self) -> int:
        return self.token_stop - self.token_start


def compute_chunk_plan(
    num_tokens: int,
    page_size: int,
    chunk_tokens: int | None = None,
    *,
    computed_tokens: int = 0,
    decode_cached_pages: int = 0,
) -> tuple[ChunkPlan, ...]:
    """Split a prompt's prefill into chunks and say which pages each chunk sends.

    - ``computed_tokens``: tokens prefill already holds KV for (its own prefix cache); the
      first chunk starts there. The last token is always computed (it yields the first
      output token).
    - ``decode_cached_pages``: decode already holds the request's first pages (a prefix
      hit); they are never sent. Only whole pages before the last token can be cached.
    - ``chunk_tokens``: chunk size (None: one chunk).

    A page is sent by the first chunk that completes it; the final chunk also sends the
    trailing partial page, so it always sends at least one page. Every page index in
    ``[decode_cached_pages, ceil(num_tokens / page_size))`` is sent exactly once, in order.
    """
    if num_tokens <= 0 or page_size <= 0:
        raise ValueError(f"num_tokens ({num_tokens}) and page_size ({page_size}) must be > 0")
    if not 0 <= computed_tokens < num_tokens:
        raise ValueError(
            f"computed_tokens ({computed_tokens}) must lie in [0, {num_tokens}): the last "
            f"token is always computed, it produces the first output token"
        )
    total_pages = -(-num_tokens // page_size)
    last_page = (num_tokens - 1) // page_size  # holds the last token: never cached
    if not 0 <= decode_cached_pages <= last_page:
        raise ValueError(
            f"decode_cached_pages ({decode_cached_pages}) outside [0, {last_page}]: page "
            f"{last_page} holds the last token, which decode never has cached"
        )
    if chunk_tokens is not None and chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    step = chunk_tokens or num_tokens
    chunks: list[ChunkPlan] = []
    next_page = decode_cached_pages
    for start in range(computed_tokens, num_tokens, step):
        stop = min(start + step, num_tokens)
        last = stop == num_tokens
        done_pages = max(next_page, total_pages if last else stop // page_size)
        chunks.append(
            ChunkPlan(
                start, stop,
                range(next_page, done_pages),
                range(next_page - decode_cached_pages, done_pages - decode_cached_pages),
                last,
            )
        )
        next_page = done_pages
    return tuple(chunks)


class PartSink(Protocol):
    """Where the driver hands parts: ``sender.PrefillSender`` (or a recording stand-in).

    ``send_part`` must return without waiting for the data: it only queues the part
    (``PrefillSender`` returns a Future resolved by its worker thread). ``pages`` are
    indices into the pages the sender holds for the request; ``layers=None`` means every
    layer (the plain path). ``ready_event`` is None on CPU (the data is complete when the
    forward call returned) and a recorded CUDA event on GPU. ``last`` is set on the
    request's final part only.
    """

    def send_part(
        self,
        room: str,
        pages: range | None = None,
        layers: range | None = None,
        *,
        last: bool = False,
        ready_event: torch.cuda.Event | None = None,
    ) -> object: ...


GroupForward = Callable[[range], object]
"""Runs the forward of the current chunk over a layer range, writing that range's KV into
the pool (enqueued on the current CUDA stream on GPU). Its return value is ignored; the
engine carries hidden states between calls itself (see ``reference.model``)."""


@dataclass(frozen=True)
class ChunkRun:
    """What ``LayerPipeline.run_chunk`` did: its groups, parts posted, events recorded."""

    groups: tuple[range, ...]
    parts_posted: int
    events_recorded: int


class LayerPipeline:
    """Runs a chunk's forward group by group and hands each group's KV to a ``PartSink``.

    One instance per prefill rank, used from the engine's forward thread. On CUDA each part
    gets an event recorded on the current stream right after its group's kernels; nothing
    here synchronises the device or the stream, so the next group's kernels queue behind
    the event while the sender waits on it. On CPU the forward call returning means the
    group's KV is in the pool, and no event is recorded.
    """

    def __init__(
        self,
        config: LayerPipelineConfig,
        num_layers: int,
        sink: PartSink,
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_layers <= 0:
            raise ValueError(f"layer pipeline: num_layers must be positive, got {num_layers}")
        compute_group_count(num_layers, config.min_tokens, config)  # validates the config
        self.config = config
        self.num_layers = num_layers
        self.sink = sink
        self.device = torch.device(device)

    def groups_for(self, num_tokens: int) -> tuple[range, ...]:
        """The layer groups a chunk of ``num_tokens`` computed tokens is split into."""
        return compute_layer_groups(self.num_layers, num_tokens, self.config)

    def run_chunk(
        self,
        room: str,
        forward: GroupForward,
        *,
        num_tokens: int,
        pages: range,
        last: bool,
    ) -> ChunkRun:
        """Compute one chunk (``num_tokens`` new tokens) and post ``pages`` group by group.

        A chunk with no pages to send (decode holds them, or a partial page waits for the
        next chunk) runs the forward in one call and posts nothing; the last chunk always
        has pages (``compute_chunk_plan``), else ValueError before any work. Raises whatever
        ``forward`` or the sink raise; parts already handed over stay with the sink.
        """
        if not pages:
            if last:
                raise ValueError(f"room {room!r}: the last chunk must send at least one page")
            forward(range(self.num_layers))
            return ChunkRun((range(self.num_layers),), 0, 0)
        groups = self.groups_for(num_tokens)
        plain = len(groups) == 1
        events = 0
        for index, group in enumerate(groups):
            forward(group)
            event = record_ready_event(self.device)
            events += event is not None
            self.sink.send_part(
                room,
                pages,
                None if plain else group,
                last=last and index == len(groups) - 1,
                ready_event=event,
            )
        return ChunkRun(groups, len(groups), events)
