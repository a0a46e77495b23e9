"""Gathers on the engine's thread, and the pre-grant arming that sets them up.

A staged RequestKV that brings a pre-grant for a request whose pages are all registered and
whose engine has given no part yet makes the worker set staging space aside for that decode
rank's whole share and prepare its gather (``arm``: page and layer ids on the device,
arguments checked). The engine's ``send_part`` of the whole request (``last=True``, every
page, every layer of this stage) then launches those gathers itself (``launch``), on the
staging stream after a device-side wait for its ready event, and the worker finds part 0
gathered and pre-granted: it only posts the WRITE, which it prepared when it set the space
aside (``Poster.prepare_share``, with ``Transport.prepare_write``: the sealed StagedPart,
the descriptors and NIXL's request; the post is then one backend call). Why: the engine's
thread launches kernels back to back, while the worker's first CUDA call after a wait costs
several times a hot launch, and host polling of the ready event is gone. Any other part
gives the space back (``disarm``), as do a Withdraw, the request's end and a resize of this
buffer; a part whose pre-grant was withdrawn after its gather asks with an AllocRequest. On
by default on CUDA (``engine_thread_gathers``); counted in ``pd_transfer_gathers_total``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from pd_transfer.errors import OversizedAllocation
from pd_transfer.kv.plan import LayerRange
from pd_transfer.kv.ring import Region
from pd_transfer.kv.staging import PreparedMove, prepare_gather, staged_chunk_bytes
from pd_transfer.prefill.context import SenderContext
from pd_transfer.prefill.posting import Poster
from pd_transfer.prefill.transfer import ReadyEvent, SendTransfer, _Gathered, _Stream

__all__ = ["EngineGathers"]

_log = logging.getLogger("pd_transfer")


@dataclass(frozen=True, eq=False)
class _EarlyGather:
    """Staging space set aside for one decode rank's whole share, and the gather into it
    that ``send_part`` launches on the engine's thread (module docstring)."""

    region: Region
    move: PreparedMove


@dataclass(frozen=True)
class _Armed:
    """A request's early gathers by decode rank, and the part that takes them: the whole
    request (every page, every layer of this stage) with ``last=True``."""

    total_pages: int
    stage: LayerRange
    gathers: dict[str, _EarlyGather]

    def covers(self, pages: range | None, layers: range | None) -> bool:
        return ((pages is None or (pages.step, pages.start, pages.stop) == (
                    1, 0, self.total_pages))
                and (layers is None or (layers.step, layers.start, layers.stop) == (
                    1, self.stage.start, self.stage.stop)))


class EngineGathers:
    """The rooms whose gathers wait for the engine's thread (module docstring)."""

    def __init__(self, ctx: SenderContext, poster: Poster, *, enabled: bool) -> None:
        """``enabled``: whether ``arm`` sets anything aside (``engine_thread_gathers``)."""
        self._ctx = ctx
        self._poster = poster  # holds the armed shares' prepared WRITEs
        self.enabled = enabled
        # The one lock the engine's thread takes, held while it launches a room's gathers
        # so the worker never frees space being gathered.
        self._armed: dict[str, _Armed] = {}
        self._armed_lock = threading.Lock()

    @property
    def any_armed(self) -> bool:
        """Some room is armed (read without the lock: ``launch`` checks again under it)."""
        return bool(self._armed)

    def armed_count(self) -> int:
        """Gathers set aside, over every room (``debug_counts``)."""
        with self._armed_lock:
            return sum(len(a.gathers) for a in self._armed.values())

    def launch(self, room: str, pages: range | None, layers: range | None,
               ready: ReadyEvent | None) -> dict[str, _Gathered]:
        """Launch ``room``'s armed gathers here if this part is the whole request: on CUDA
        the staging stream waits for ``ready`` on the device (no host poll). Called on the
        engine's thread, inside ``send_part``; {} leaves the part to the worker."""
        stream = self._ctx.stream
        wait = ready if isinstance(ready, torch.cuda.Event) else None
        if stream is None:
            if ready is not None and not ready.query():
                return {}  # CPU: the gather runs in this call, so the KV must be there
        elif wait is None:
            return {}  # an engine's own ReadyEvent: only the worker can poll it
        with self._armed_lock:
            armed = self._armed.get(room)
            if armed is None or not armed.covers(pages, layers):
                return {}
            del self._armed[room]
            try:
                if stream is not None and wait is not None:
                    stream.stream.wait_event(wait)
                for early in armed.gathers.values():
                    early.move.launch(stream.stream if stream is not None else None)
                event = stream.record() if stream is not None else None
            except Exception:  # the worker gathers it; the set-aside space goes at the end
                _log.exception("room %s: a gather on the engine's thread failed; the "
                               "transfer worker gathers the part", room)
                return {}
            at = self._ctx.clock()
        self._ctx.metrics.gathers_launched("engine", len(armed.gathers))
        return {peer: _Gathered(early.region, early.move.nbytes, event, at)
                for peer, early in armed.gathers.items()}

    def arm(self, transfer: SendTransfer, stream: _Stream) -> None:
        """Set staging space aside for ``stream``'s whole share and prepare its gather, for
        the engine's thread to launch in ``send_part``: only while no part was given, with
        every page registered, a pre-grant of the peer's ring in force and no resize."""
        ctx = self._ctx
        pregrant = stream.pregrant
        if (not self.enabled or stream.path != "staged" or pregrant is None
                or transfer.specs or ctx.resizing()
                or len(transfer.src_pages) != transfer.total_pages
                or pregrant.ring_version != ctx.peer_document(stream).ring_version):
            return
        stage, plan = ctx.stage, stream.plan
        layers = range(plan.layers.start - stage.start, plan.layers.stop - stage.start)
        pages = range(stream.first_page, transfer.total_pages)
        size = staged_chunk_bytes(ctx.pool.layout, len(layers), len(pages),
                                  plan.heads.num_heads)
        try:
            region = ctx.buffer.ring.allocate(transfer.room, size)
        except OversizedAllocation:
            return  # the worker's path fails the part with what to change
        if region is None:
            return  # the buffer is full now; the worker gathers it when space frees
        move = prepare_gather(
            ctx.pool, layers, transfer.page_ids(ctx.pool).select(pages.start, pages.stop),
            head_start=plan.heads.src_head_offset, num_heads=plan.heads.num_heads,
            out=ctx.buffer.view(region, size))
        if not move.compiled:  # a new kernel compiles on the worker, not in the engine's step
            ctx.buffer.ring.free(region)
            return
        self._poster.prepare_share(transfer, stream, pages, pregrant, region, size)
        with self._armed_lock:
            armed = self._armed.setdefault(transfer.room, _Armed(
                transfer.total_pages, stage, {}))
            armed.gathers[stream.peer] = _EarlyGather(region, move)

    def disarm(self, room: str | None = None, peer: str | None = None) -> None:
        """Take back what the engine's thread has not taken: ``room``'s gathers (only
        ``peer``'s, if given), or every room's; their staging space is freed."""
        with self._armed_lock:
            rooms = [room] if room is not None else list(self._armed)
            taken: list[tuple[str, str, _EarlyGather]] = []
            for name in rooms:
                armed = self._armed.get(name)
                if armed is None:
                    continue
                for gone in [peer] if peer is not None else list(armed.gathers):
                    if (early := armed.gathers.pop(gone, None)) is not None:
                        taken.append((name, gone, early))
                if not armed.gathers:
                    del self._armed[name]
        for name, gone, early in taken:
            self._ctx.buffer.ring.free(early.region)
            self._poster.discard_share(name, gone)

    def release(self, room: str) -> None:
        """``room`` ended: drop its gathers and free all of its staging space."""
        # Under the lock the engine's thread holds from taking a room's gathers to their
        # launch: space it gathers into is freed after that launch, so a gather of the next
        # owner is queued behind it on the staging stream, never before it.
        with self._armed_lock:
            self._armed.pop(room, None)
            self._ctx.buffer.ring.free_owner(room)
