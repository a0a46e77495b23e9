"""``RingGrants``, decode's ring bookkeeping, on its own: no transport, no endpoint, no GPU.

Real small objects: requests (``ReceiveTransfer``) with one writer each, built from a real
1→1 plan, the real ``StagingRing`` (256-byte alignment, next-fit from the end of the last
region, back to offset 0 when empty) and a hand-moved clock. Every offset, size and order
below is worked out by hand from those rules, next to its assert.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pd_transfer.decode import ReceiveTransfer, RingGrants
from pd_transfer.errors import OversizedAllocation
from pd_transfer.kv.layout import KVLayout
from pd_transfer.kv.plan import KVGeometry, Parallelism, RankCoord, compute_transfer_topology
from pd_transfer.protocol.parts import PartEvent, PartMachine, PartState

_PLAN = compute_transfer_topology(
    KVGeometry(num_layers=2, total_kv_heads=2, head_dim=4, element_size_bytes=2),
    Parallelism(tp=1), Parallelism(tp=1)).plans_into(RankCoord(0, 0))[0]
_LAYOUT = KVLayout(num_layers=2, num_pages=16, page_size=4, kv_heads=2, head_dim=4,
                   dtype=torch.bfloat16)


@dataclass
class _Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Ring:
    """A ``RingGrants`` with the live requests it reads and what it reported."""

    ring_bytes: int = 4096
    pregrant_share: float = 1.0
    clock: _Clock = field(default_factory=_Clock)
    transfers: dict[str, ReceiveTransfer] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)  # rooms whose release callback ran
    unpinned: list[int] = field(default_factory=list)  # on_unpinned's versions, in order
    machine: PartMachine = field(default_factory=PartMachine)

    def __post_init__(self) -> None:
        self.grants = RingGrants(self.ring_bytes, pregrant_share=self.pregrant_share,
                                 resend_s=0.25, transfers=self.transfers, parts=self.machine,
                                 clock=self.clock, on_unpinned=self.unpinned.append)

    def request(self, room: str, peer: str = "prefill-a") -> ReceiveTransfer:
        """A live request with one staged writer (sender id 0) on ``peer``; tickets are 1, 2,
        3, ... in the order requests are made."""
        transfer = ReceiveTransfer(room, len(self.transfers) + 1, self.clock(),
                                   lambda t: self.released.append(t.room), bootstrap_s=2.0,
                                   dst_pages=[0, 1], num_tokens=8, instance=None,
                                   mode="staged")
        transfer.add_writer(peer, _PLAN, _LAYOUT, "staged", self.clock())
        self.transfers[room] = transfer
        return transfer

    def ask(self, transfer: ReceiveTransfer, index: int, size_bytes: int) -> bool:
        """The receiver's AllocRequest path: granted at once (True) or queued (False)."""
        writer = transfer.writers[0]
        part = writer.part(index)
        part.size_bytes = size_bytes
        region = self.grants.allocate(transfer.room, size_bytes)
        if region is None:
            self.grants.enqueue(transfer, writer, part)
            return False
        self.grants.give(writer, part, region)
        return True

    def pregrant(self, transfer: ReceiveTransfer, size_bytes: int) -> bool:
        return self.grants.pregrant(transfer, transfer.writers[0], size_bytes) is not None

    def serve(self) -> list[tuple[str, int, int]]:
        """Grant the queue's head while it fits: (room, offset, size) in grant order."""
        granted = []
        while (taken := self.grants.grant_head()) is not None:
            queued, region = taken
            assert not isinstance(region, OversizedAllocation)
            self.grants.give(queued.writer, queued.part, region)
            granted.append((queued.transfer.room, region.offset_bytes, region.size_bytes))
        return granted


def _span(transfer: ReceiveTransfer, index: int = 0) -> tuple[int, int]:
    region = transfer.writers[0].parts[index].region
    assert region is not None
    return region.offset_bytes, region.size_bytes


def _state(transfer: ReceiveTransfer, index: int = 0) -> PartState:
    return transfer.writers[0].part(index).state


# Grants and the queue -----------------------------------------------------------------------

def test_queued_parts_are_granted_first_in_first_out_once_space_frees() -> None:
    """The FIFO of docs/failure-modes.md #5: parts that found the ring full wait and are
    then granted in arrival order, each where the previous one ended."""
    ring = _Ring()
    a, b, c, d = (ring.request(room) for room in "abcd")
    ring.clock.now = 1.0
    assert ring.ask(a, 0, 4096)  # the whole ring: [0, 4096)
    assert (ring.ask(b, 0, 2048), ring.ask(c, 0, 1024), ring.ask(d, 0, 512)) == (
        False, False, False)
    assert ring.grants.queued == 3
    assert [_state(t) for t in (a, b, c, d)] == [PartState.GRANTED] + [PartState.QUEUED] * 3
    assert ring.serve() == []  # nothing fits yet: b stays at the head
    region = a.writers[0].parts[0].region
    assert region is not None and ring.grants.ring.free(region)
    ring.clock.now = 2.0
    # The ring is empty again, so next-fit starts at 0: b [0, 2048), c right after it at
    # 2048 (1024 bytes), d right after c at 2048 + 1024 = 3072 (512 bytes).
    assert ring.serve() == [("b", 0, 2048), ("c", 2048, 1024), ("d", 3072, 512)]
    assert ring.grants.queued == 0
    assert ring.grants.ring.used_bytes == 2048 + 1024 + 512
    part = b.writers[0].parts[0]
    assert (part.state, part.granted_at, part.ring_version) == (PartState.GRANTED, 2.0, 1)


def test_a_big_part_at_the_head_is_not_passed_by_a_smaller_one_behind_it() -> None:
    """FIFO, not best-fit: a small part queued behind a big one waits even though it would
    fit now, so the big one is not starved."""
    ring = _Ring()
    a, x, b, c = (ring.request(room) for room in "axbc")
    assert ring.ask(a, 0, 3072) and ring.ask(x, 0, 1024)  # [0, 3072), [3072, 4096): full
    assert not ring.ask(b, 0, 2048)
    assert not ring.ask(c, 0, 512)
    region = x.writers[0].parts[0].region
    assert region is not None and ring.grants.ring.free(region)  # [3072, 4096) is free
    assert ring.serve() == []  # b (2048) does not fit 1024; c (512) would, but waits
    assert (_state(b), _state(c), ring.grants.queued) == (PartState.QUEUED, PartState.QUEUED, 2)
    assert ring.grants.ring.used_bytes == 3072
    region = a.writers[0].parts[0].region
    assert region is not None and ring.grants.ring.free(region)  # empty: next-fit from 0
    assert ring.serve() == [("b", 0, 2048), ("c", 2048, 512)]


def test_a_queued_part_that_no_longer_fits_the_shrunk_ring_comes_back_with_its_reason() -> None:
    """A part queued before a resize to a smaller ring can never fit: ``grant_head`` takes
    it off the queue with its OversizedAllocation (the receiver refuses it); the next one is
    served."""
    ring = _Ring()
    a, b, c = (ring.request(room) for room in "abc")
    assert ring.ask(a, 0, 4096)
    assert not ring.ask(b, 0, 3072)
    assert not ring.ask(c, 0, 1024)
    ring.grants.swap(2048)
    assert (ring.grants.version, ring.grants.ring.capacity_bytes) == (2, 2048)
    taken = ring.grants.grant_head()
    assert taken is not None
    queued, refusal = taken
    assert queued.transfer is b and isinstance(refusal, OversizedAllocation)
    assert (refusal.size_bytes, ring.grants.queued) == (3072, 1)
    assert ring.serve() == [("c", 0, 1024)]  # the new ring is empty: c at 0
    assert c.writers[0].parts[0].ring_version == 2


# Pre-grants ---------------------------------------------------------------------------------

def test_pregrants_stay_within_their_share_of_the_ring() -> None:
    """``pregrant_share`` 0.5 of 4096 bytes: live pre-grants may hold 2048 bytes."""
    ring = _Ring(pregrant_share=0.5)
    a, b, c = (ring.request(room) for room in "abc")
    ring.clock.now = 3.0
    assert ring.pregrant(a, 1024)  # [0, 1024); 1024 of 2048 held
    assert ring.pregrant(b, 1024)  # [1024, 2048); 2048 of 2048 held
    assert not ring.pregrant(c, 256)  # 2048 + 256 > 2048, though the ring has 2048 free
    assert (_span(a), _span(b)) == ((0, 1024), (1024, 1024))
    part = a.writers[0].parts[0]
    assert (part.state, part.pregranted, part.size_bytes, part.granted_at) == (
        PartState.GRANTED, True, 1024, 3.0)
    assert c.writers[0].parts == {}  # no part 0 is made when none is granted
    assert ring.grants.pregranted_bytes() == 2048
    assert [held[0].room for held in ring.grants.pregrants()] == ["a", "b"]


def test_no_pregrant_while_a_part_is_queued_or_when_the_ring_has_no_room() -> None:
    """A queued part goes first; a share that does not fit now (or ever) is not granted
    ahead: part 0 then asks with an AllocRequest."""
    ring = _Ring()
    a, b, c, d = (ring.request(room) for room in "abcd")
    assert ring.ask(a, 0, 3072)
    assert not ring.ask(b, 0, 2048)  # queued
    assert not ring.pregrant(c, 512)  # 1024 bytes are free, but b waits
    region = a.writers[0].parts[0].region
    assert region is not None
    ring.grants.ring.free(region)
    assert ring.serve() == [("b", 0, 2048)]
    assert not ring.pregrant(c, 4096)  # only 2048 free now
    assert not ring.pregrant(d, 8192)  # larger than the ring: never
    assert (c.writers[0].parts, d.writers[0].parts) == ({}, {})
    assert ring.pregrant(c, 2048)  # [2048, 4096): the rest of the ring
    assert _span(c) == (2048, 2048)


def test_the_latest_unwritten_pregrants_are_asked_back_until_the_head_could_fit() -> None:
    """Requests still computing never keep the ring from a part already moving: when the
    head does not fit, the latest pre-grants are named, only as many as it needs."""
    ring = _Ring()
    a, b, c, d = (ring.request(room) for room in "abcd")
    for now, transfer in ((1.0, a), (2.0, b), (3.0, c)):
        ring.clock.now = now
        assert ring.pregrant(transfer, 1024)
    assert [_span(t) for t in (a, b, c)] == [(0, 1024), (1024, 1024), (2048, 1024)]
    assert not ring.ask(d, 0, 3072)  # 1024 free at [3072, 4096): queued
    # Needed 3072; free extent 1024. c (latest, 3.0): 1024 + 1024 = 2048 < 3072, so b
    # (2.0) too: 3072, exactly enough; a is kept.
    assert [held[0].room for held in ring.grants.to_reclaim()] == ["c", "b"]
    # c's WRITE is posted (its StagedPart landed): it keeps its region, so b and a go.
    ring.machine.apply(c.writers[0].parts[0], PartEvent.LAND)
    assert [held[0].room for held in ring.grants.live_pregrants()] == ["a", "b"]
    assert [held[0].room for held in ring.grants.to_reclaim()] == ["b", "a"]
    assert ring.grants.pregranted_bytes() == 3 * 1024  # c's is still held (its scatter)


def test_pregrants_granted_at_the_same_moment_are_asked_back_later_request_first() -> None:
    """Ties in ``granted_at`` (one step, one clock reading) go to the later request: the
    earlier one is closer to being written."""
    ring = _Ring()
    a, b, c = (ring.request(room) for room in "abc")
    ring.clock.now = 1.0
    assert ring.pregrant(a, 1536) and ring.pregrant(b, 1536)  # [0, 1536), [1536, 3072)
    assert not ring.ask(c, 0, 2048)  # 1024 free
    assert [held[0].room for held in ring.grants.to_reclaim()] == ["b"]  # 1024 + 1536 >= 2048
    assert ring.serve() == []


def test_nothing_is_asked_back_without_a_queued_part() -> None:
    """A pre-grant holding the whole ring is left alone while no part waits for space."""
    ring = _Ring()
    assert ring.pregrant(ring.request("a"), 4096)
    assert ring.grants.to_reclaim() == []


def test_a_withdraw_is_asked_again_only_after_resend_s() -> None:
    """``withdraw_due`` spaces the Withdraws for one pre-grant ``resend_s`` (0.25 s) apart
    and records each one it allows."""
    ring = _Ring()
    a = ring.request("a")
    assert ring.pregrant(a, 1024)
    part = a.writers[0].parts[0]
    assert ring.grants.withdraw_due(part, 5.0) and part.withdraw_sent_at == 5.0
    assert not ring.grants.withdraw_due(part, 5.125)  # 0.125 < 0.25
    assert part.withdraw_sent_at == 5.0
    assert ring.grants.withdraw_due(part, 5.25)  # 0.25 since the last ask
    assert part.withdraw_sent_at == 5.25


def test_a_pregrant_given_back_frees_its_region_and_forgets_the_part() -> None:
    """A Withdrawn (or an AllocRequest for part 0) returns an unwritten pre-grant: its
    region is free at once and part 0 is Unseen again, no longer counted in the share."""
    ring = _Ring()
    a, b = ring.request("a"), ring.request("b")
    assert ring.pregrant(a, 1024) and ring.pregrant(b, 1024)  # [0, 1024), [1024, 2048)
    part = a.writers[0].parts[0]
    ring.grants.give_back(a.writers[0], part)
    assert (part.region, part.state, a.writers[0].parts) == (None, PartState.UNSEEN, {})
    assert ring.grants.ring.used_bytes == 1024  # b's only
    assert ring.grants.pregranted_bytes() == 1024
    assert [held[0].room for held in ring.grants.pregrants()] == ["b"]


# Endings and the quarantine -------------------------------------------------------------------

def test_a_failed_requests_regions_are_freed_or_quarantined_by_what_may_still_be_written() -> None:
    """On release: a Scattering part's region is freed (its scatter was waited for), a
    Granted one is quarantined while its writer lives and freed if it is dead, a Queued
    part leaves the queue; the request's parts are dropped."""
    ring = _Ring()
    live, dead, other = ring.request("live"), ring.request("dead", "prefill-b"), ring.request("x")
    assert ring.ask(live, 0, 1024) and ring.ask(live, 1, 512)  # [0, 1024), [1024, 1536)
    assert ring.ask(dead, 0, 512)  # [1536, 2048)
    assert ring.ask(other, 0, 2048)  # [2048, 4096): the ring is full
    assert not ring.ask(live, 2, 256)  # queued
    ring.machine.apply(live.writers[0].parts[1], PartEvent.LAND)  # part 1 scatters
    ring.grants.release(live, live_peers={"prefill-a"}, expiry=30.0)
    (entry,) = ring.grants.quarantined
    assert (entry.region.offset_bytes, entry.region.size_bytes, entry.writer, entry.expiry,
            entry.ring_version, entry.pregranted) == (0, 1024, "prefill-a", 30.0, 1, False)
    assert live.writers[0].parts == {} and ring.grants.queued == 0
    assert ring.grants.ring.used_bytes == 1024 + 512 + 2048  # quarantined, dead's, other's
    ring.grants.release(dead, live_peers={"prefill-a"}, expiry=30.0)  # prefill-b is gone
    assert len(ring.grants.quarantined) == 1
    assert ring.grants.ring.used_bytes == 1024 + 2048


def test_a_quarantined_region_is_released_only_by_a_staged_part_of_its_own_room() -> None:
    """docs/failure-modes.md #16: the late StagedPart of the failed room releases the
    region; one of another room naming the same bytes (a finished room's notification sent
    again) or of another size leaves it held."""
    ring = _Ring()
    failed = ring.request("failed")
    assert ring.ask(failed, 0, 1000)  # [0, 1000), 1024 reserved
    ring.grants.release(failed, live_peers={"prefill-a"}, expiry=30.0)
    assert not ring.grants.late_write("prefill-a", "finished", 1, 0, 1000, 1)  # another room
    assert not ring.grants.late_write("prefill-a", "failed", 1, 0, 768, 1)  # not its size
    assert not ring.grants.late_write("prefill-b", "failed", 1, 0, 1000, 1)  # not its writer
    assert not ring.grants.late_write("prefill-a", "failed", 1, 0, 1000, 2)  # not its ring
    # The same room id, another request: an earlier incarnation's notification sent again.
    assert not ring.grants.late_write("prefill-a", "failed", 9, 0, 1000, 1)
    assert ring.grants.ring.used_bytes == 1024
    assert [e.region.owner for e in ring.grants.quarantined] == ["failed"]
    assert ring.grants.late_write("prefill-a", "failed", 1, 0, 1000, 1)
    assert ring.grants.quarantined == () and ring.grants.ring.used_bytes == 0
    assert ring.unpinned == []  # a region of the ring in force: no buffer to let go


def test_a_quarantined_pregrant_takes_a_smaller_late_write_or_its_withdrawn() -> None:
    """A pre-granted region's part may fill only its start; an unwritten one comes back
    with a Withdrawn. A plain grant is not released by a Withdrawn."""
    ring = _Ring()
    pre, pre2, plain = ring.request("pre"), ring.request("pre2"), ring.request("plain")
    assert ring.pregrant(pre, 2048) and ring.pregrant(pre2, 1024)  # [0, 2048), [2048, 3072)
    assert ring.ask(plain, 0, 512)  # [3072, 3584)
    for transfer in (pre, pre2, plain):
        ring.grants.release(transfer, live_peers={"prefill-a"}, expiry=30.0)
    assert [e.region.owner for e in ring.grants.quarantined] == ["pre", "pre2", "plain"]
    assert ring.grants.late_write("prefill-a", "pre", 1, 0, 512, 1)  # 512 <= 2048, its start
    assert not ring.grants.late_withdrawn("prefill-a", "plain", 3)  # not a pre-grant
    assert not ring.grants.late_withdrawn("prefill-a", "pre2", 1)  # another incarnation's
    assert ring.grants.late_withdrawn("prefill-a", "pre2", 2)
    assert [e.region.owner for e in ring.grants.quarantined] == ["plain"]
    assert ring.grants.ring.used_bytes == 512


def test_quarantine_ends_at_its_expiry_or_with_its_writer() -> None:
    """``quarantine_grace_s`` bounds a region's quarantine; a writer known dead writes
    nothing more, so its regions go at once and only its."""
    ring = _Ring()
    a, b, c = ring.request("a"), ring.request("b", "prefill-b"), ring.request("c")
    assert ring.ask(a, 0, 256) and ring.ask(b, 0, 256) and ring.ask(c, 0, 256)
    ring.grants.release(a, live_peers={"prefill-a", "prefill-b"}, expiry=30.0)
    ring.grants.release(b, live_peers={"prefill-a", "prefill-b"}, expiry=31.0)
    ring.grants.release(c, live_peers={"prefill-a", "prefill-b"}, expiry=32.0)
    ring.grants.expire(29.5)
    assert len(ring.grants.quarantined) == 3
    ring.grants.expire(30.0)  # a's grace ran out (expiry <= now)
    assert [e.region.owner for e in ring.grants.quarantined] == ["b", "c"]
    ring.grants.drop_writer("prefill-a")  # c's writer died: b's (prefill-b) stays
    assert [e.region.owner for e in ring.grants.quarantined] == ["b"]
    assert ring.grants.ring.used_bytes == 256


def test_a_retired_rings_buffer_is_let_go_when_its_last_quarantined_region_is() -> None:
    """A resize while regions of the old ring are quarantined: the old ring's version stays
    pinned until the last of them is dropped, then ``on_unpinned`` names it, once."""
    ring = _Ring()
    a, b = ring.request("a"), ring.request("b")
    assert ring.ask(a, 0, 1024) and ring.ask(b, 0, 1024)  # [0, 1024), [1024, 2048)
    for transfer in (a, b):
        ring.grants.release(transfer, live_peers={"prefill-a"}, expiry=30.0)
    ring.grants.swap(8192)
    assert (ring.grants.version, ring.grants.pins(1), ring.grants.pins(2)) == (2, True, False)
    assert ring.grants.ring.used_bytes == 0  # the new ring holds none of the old regions
    assert ring.grants.late_write("prefill-a", "a", 1, 0, 1024, 1)
    assert ring.unpinned == [] and ring.grants.pins(1)  # b's region still pins it
    ring.grants.expire(30.0)
    assert ring.unpinned == [1] and not ring.grants.pins(1)
    assert ring.grants.ring.used_bytes == 0

