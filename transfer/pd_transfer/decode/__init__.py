"""The decode side: ``DecodeReceiver`` asks prefill ranks for a request's KV and lands it.

Engine API (any thread; calls return Futures resolved on the worker thread):
``expect(room, page_ids, num_tokens, prefill_instance=None, mode=None)`` → ``poll(room)``
until ``finished``; ``abort(room)``. The pages may be read once the status is Succeeded.

Files, in reading order: ``receiver.py`` (``DecodeReceiver``: the engine API, asking the
prefill ranks, message dispatch, deadlines, endings, the ring's resize), ``transfer.py``
(``ReceiveTransfer``: one request's writers and parts), ``context.py``
(``ReceiverContext``: what the collaborators, allocations.py and arrivals.py, use of the
endpoint: they never import the receiver), ``grants.py`` (``RingGrants``: the ring's
bookkeeping, pure), ``allocations.py`` (AllocRequest, pre-grants, Withdraw),
``arrivals.py`` (StagedPart, PartDone, completion), ``scatter.py`` (the scatters on the
device).

One ``ReceiveTransfer`` per request owns all of its state: per expected writer (a prefill
rank, by sender id) its plan and path, its final part count once known, and its parts,
each in one ``PartState`` (Queued, Granted, Scattering, Arrived: protocol/parts.py; a
granted part holds its ring region). Completion is decided by resources, never by an
``is_last`` flag (docs/failure-modes.md #8): every writer reported its final count, that
many parts are Arrived (notification arrived, scattered), and none is Queued, Granted or
Scattering. Only a WRITE's notification (StagedPart / PartDone) counts a part as arrived
(docs/failure-modes.md #9).

The ring (docs/failure-modes.md #4-#7, #16): regions are granted per (room, writer, part),
re-granted identically to a re-sent AllocRequest, queued FIFO when the ring is full (the
writer gets a Watermark), refused for good when larger than the ring (GrantRefused; only
that request fails, OversizedChunk). A region granted but unwritten for ``stall_s`` fails
its request (StalledWriter). When a request fails, regions a live writer may still write
into are QUARANTINED (kept occupied) until its late notification arrives, the writer is
known dead, or ``quarantine_grace_s`` passed; everything else is freed at once.

Pre-grants (protocol v5): a staged writer's RequestKV carries a region for its part 0 as
large as the writer's whole share of the request, granted at once when no allocation is
queued and live pre-grants stay within ``pregrant_share`` of the ring, so the first part
skips the AllocRequest / Grant round trip (by default on CUDA only, up to the whole ring:
``PREGRANT_SHARE``). Requests whose KV is still being computed never keep the ring from
parts already moving: when the queued part at the head does not fit, decode asks unwritten
pre-grants back, the latest granted first, until they and the largest free extent could hold
it (``Withdraw``, re-sent every ``grant_s``; ``pd_transfer_pregrants_total{outcome=
reclaimed}``); a writer that has posted its WRITE keeps its region. It is a Granted part
like any other (freed when scattered, quarantined when its request fails while the writer
lives) except that: its StagedPart may be smaller than the region, whose tail is freed when
it lands; no stall watchdog runs on it (the writer may still be computing the KV: the
transfer deadline bounds it); an AllocRequest for it means the writer could not use it (it
gives it back: the region is freed and the request served as new); and a resize asks for it
back (``Withdraw``, re-sent every ``grant_s``) so that a writer still computing does not
hold the drain to its deadline. Its scatter is prepared with the grant: the share's page and
layer ids on the device, the arguments checked, the kernel bound
(``staging.prepare_scatter``), so a StagedPart that is the whole share only launches it; any
other part's scatter is prepared when its StagedPart arrives
(``pd_transfer_scatters_total{prepared=grant|notification}``).

Hot resize (``Endpoint.resize(staging, deadline_s)``, to the ``AgentStaging``'s decode pool
size): no new region is granted (new AllocRequests queue FIFO, answered with a Watermark,
bounded by their own deadlines); granted regions finish (written, scattered, freed) until
the deadline; a request still holding a granted region then fails ResizeDeadline and the
region is quarantined. The old buffer is deregistered (and kept allocated while a
quarantined region of it may still be written), the new one allocated and registered,
``ring_version`` bumped and announced to every prefill peer (``RingUpdate``); then the
queue is served against the new ring. Grants carry the version; a StagedPart of another
version is a protocol violation (its request). No pre-grant is given while a resize is
under way.
"""

from pd_transfer.decode.grants import RingGrants
from pd_transfer.decode.receiver import PREGRANT_SHARE, DecodeReceiver
from pd_transfer.decode.transfer import ReceiveTransfer

__all__ = ["PREGRANT_SHARE", "DecodeReceiver", "ReceiveTransfer", "RingGrants"]
