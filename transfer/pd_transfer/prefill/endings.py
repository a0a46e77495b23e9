"""A prefill request's deadlines, re-notifications and release.

Deadlines: no RequestKV within ``kv_lease_s`` → LeaseExpired (the KV hold has a lease,
docs/failure-modes.md #18); ``transfer_s`` from the first RequestKV → TransferTimeout; an
AllocRequest is re-sent every ``grant_s`` and after ``grant_retries`` unanswered re-sends →
GrantTimeout. A stream whose parts are all written but whose Release has not come within
``max(grant_s, stall_s / 4)`` sends the parts' notifications again as messages, at most
``grant_retries`` rounds (``_renotify``: a WRITE's notification can be lost while its data
landed).

Release, on either terminal state: WRITEs in flight are released, staging space and
prepared WRITEs freed, an unwritten pre-grant given back with ``Withdrawn``; a failed
request first logs where each part it left unwritten stopped.
"""

from __future__ import annotations

import logging

from pd_transfer.common.phases import Stamp
from pd_transfer.errors import TransportError
from pd_transfer.prefill.context import SenderContext
from pd_transfer.prefill.gathers import EngineGathers
from pd_transfer.prefill.posting import Poster
from pd_transfer.prefill.transfer import SendTransfer, _OutPart, _Stream
from pd_transfer.protocol import messages as wire
from pd_transfer.protocol.lifecycle import FailureReason, State
from pd_transfer.protocol.parts import PartState

__all__ = ["Endings"]

_log = logging.getLogger("pd_transfer")


class Endings:
    """Deadlines and release of a request (module docstring); worker thread."""

    def __init__(self, ctx: SenderContext, gathers: EngineGathers, poster: Poster) -> None:
        self._ctx = ctx
        self._engine_gathers = gathers  # what is set aside for a room goes at its end
        self._poster = poster  # as do its prepared WRITEs

    def check(self, transfer: SendTransfer, now: float) -> None:
        """Fail ``transfer`` past a deadline; re-send unanswered AllocRequests and, per
        stream, notifications decode has not answered with a Release."""
        ctx = self._ctx
        timeouts = ctx.timeouts
        state = transfer.lifecycle.state
        if state is State.BOOTSTRAPPING and now >= transfer.lease_deadline:
            ctx.fail(transfer, FailureReason.LEASE_EXPIRED,
                     f"no decode rank asked for this KV within {timeouts.kv_lease_s} s")
            return
        if state is not State.TRANSFERRING:
            return
        if now >= transfer.transfer_deadline:
            ctx.fail(transfer, FailureReason.TRANSFER_TIMEOUT,
                     f"not finished within {timeouts.transfer_s} s")
            return
        for stream in transfer.streams.values():
            known = ctx.peer_document(stream).ring_version
            for out in stream.out.values():
                if out.state is not PartState.AWAITING_GRANT:
                    continue
                # A grant in a ring whose RingUpdate has not arrived is no grant yet: the
                # update may be lost, and a re-sent AllocRequest makes decode send it again.
                if out.grant is not None and out.grant.ring_version <= known:
                    continue
                if now - out.alloc_sent_at < timeouts.grant_s:
                    continue
                out.retries += 1
                if out.retries > timeouts.grant_retries:
                    missing = ("no grant" if out.grant is None else
                               f"a grant in ring version {out.grant.ring_version} but no "
                               f"RingUpdate for it (version {known} in force)")
                    ctx.fail(transfer, FailureReason.GRANT_TIMEOUT,
                             f"{missing} from {stream.peer} for part {out.index} after "
                             f"{timeouts.grant_retries} re-sends")
                    return
                out.alloc_sent_at = now
                ctx.send(stream.peer, stream.alloc_request(transfer.room, out))
            self._renotify(transfer, stream, now)

    def _renotify(self, transfer: SendTransfer, stream: _Stream, now: float) -> None:
        """Send the notifications of ``stream``'s written parts again, as messages, when
        every part is written and decode's Release has not come within a quarter of the
        stall watchdog's time (at least ``grant_s``): a WRITE's data can land while its
        notification is lost (NIXL's UCX backend drops one in a known case), and decode
        would wait for it until its watchdog failed the request. Decode counts a copy of a
        notification it had as a duplicate and acts on a missing one; a slow decode's
        Release (a scatter still running) usually comes first. At most ``grant_retries``
        rounds."""
        ctx = self._ctx
        wait_s = max(ctx.timeouts.grant_s, ctx.timeouts.stall_s / 4)
        if (stream.released or not stream.written or stream.out or not transfer.last_given
                or stream.next_spec < len(transfer.specs) or now - stream.written_at < wait_s
                or stream.renotified >= ctx.timeouts.grant_retries):
            return
        stream.renotified += 1
        stream.written_at = now
        _log.info("room %s: no Release from %s %.1f s after its last WRITE; sending the "
                  "notifications of parts %s again (round %d)", transfer.room, stream.peer,
                  wait_s, sorted(stream.written), stream.renotified)
        ctx.metrics.notifications_resent(len(stream.written))
        for note in list(stream.written.values()):
            if not ctx.send_sealed(stream.peer, note):
                return

    def release(self, transfer: SendTransfer) -> None:
        """Terminal (the endpoint has forgotten the request): abort WRITEs in flight, free
        staging. Runs once."""
        ctx = self._ctx
        if transfer.lifecycle.state is State.FAILED:
            self._log_unwritten(transfer)
        for stream in transfer.streams.values():
            part0 = stream.out.get(0)
            unwritten = stream.pregrant is not None or (
                part0 is not None and part0.pregranted and part0.state is PartState.AWAITING_GRANT)
            if unwritten and stream.peer in ctx.peers:  # decode may free it before its grace
                ctx.send(stream.peer, wire.Withdrawn(room=transfer.room, ticket=stream.ticket,
                                                     sender_id=stream.plan.sender_id))
            for out in stream.out.values():
                if out.handle is not None:
                    try:
                        ctx.transport.release(out.handle)
                    except TransportError as exc:
                        _log.warning("room %s: releasing a WRITE: %s", transfer.room, exc)
            stream.out.clear()
            self._poster.discard_share(transfer.room, stream.peer)
        self._engine_gathers.release(transfer.room)

    def _log_unwritten(self, transfer: SendTransfer) -> None:
        """Where each part a failed request left unwritten stopped: the line a decode rank's
        failure of the same room (a StalledWriter, say) is read against."""
        now = self._ctx.clock()
        left = [f"to {stream.peer}: part {out.index} {self._where(out, now)}"
                for stream in transfer.streams.values() for out in stream.out.values()]
        if left:
            reason = transfer.lifecycle.reason
            _log.warning("room %s failed (%s) with parts unwritten: %s", transfer.room,
                         reason.value if reason is not None else "no reason", "; ".join(left))

    def _where(self, out: _OutPart, now: float) -> str:
        """``out``'s state, with how long ago it was given and what it waits for."""
        where = [out.state.value, _ago("given", out.stamps.get(Stamp.GIVEN), now)]
        if out.state is PartState.AWAITING_GRANT:
            if out.grant is None:
                where.append("no grant")
            else:
                where.append(f"{'pre-' if out.pregranted else ''}granted {out.grant.size_bytes}"
                             f" bytes at {out.grant.ring_offset} of ring version "
                             f"{out.grant.ring_version}")
            where.append("gathered" if Stamp.GATHERED in out.stamps else "gather pending")
        elif out.state is PartState.WRITING and out.handle is not None:
            try:
                write = self._ctx.transport.state(out.handle).value
            except TransportError as exc:
                write = f"unknown ({exc})"
            where.append(f"{_ago('posted', out.stamps.get(Stamp.POSTED), now)}, the WRITE {write}")
        return ", ".join(where)


def _ago(step: str, at: float | None, now: float) -> str:
    return step if at is None else f"{step} {now - at:.1f} s ago"
