"""Staging ring: invariants under random operation sequences, and the release paths.

Unit tests: pure bookkeeping, no buffer, no NIXL. The property test replays thousands of
seeded random operations against a bytearray occupancy model and checks every invariant
after every step.
"""

from __future__ import annotations

import itertools
import random

import pytest

from pd_transfer.errors import OversizedAllocation, RingError
from pd_transfer.kv.ring import Region, StagingRing

MiB = 1 << 20


def test_empty_ring_accepts_exactly_its_capacity_then_nothing() -> None:
    ring = StagingRing(4096, alignment_bytes=256)
    whole = ring.allocate("a", 4096)
    assert whole is not None
    assert (whole.offset_bytes, whole.reserved_bytes) == (0, 4096)
    assert ring.allocate("b", 1) is None  # full: no room right now, not an error
    assert ring.free(whole)
    assert ring.allocate("b", 4096) is not None


def test_wrapped_cursor_resets_when_the_ring_empties() -> None:
    """Guards docs/failure-modes.md #5: after a wrap, an empty ring must still take a full-size
    chunk."""
    ring = StagingRing(1024, alignment_bytes=256)
    first = ring.allocate("a", 768)  # [0, 768)
    second = ring.allocate("b", 256)  # [768, 1024)
    assert first is not None and second is not None
    ring.free(first)
    wrapped = ring.allocate("c", 512)  # tail full -> wraps to [0, 512)
    assert wrapped is not None and wrapped.offset_bytes == 0
    ring.free(second)
    ring.free(wrapped)
    assert ring.used_bytes == 0
    assert ring.allocate("d", 1024) is not None


def test_allocation_follows_the_cursor_then_wraps() -> None:
    ring = StagingRing(1024, alignment_bytes=256)
    a, b, c = (ring.allocate(o, 256) for o in "abc")  # [0,256) [256,512) [512,768)
    assert a is not None and b is not None and c is not None
    ring.free(a)
    d = ring.allocate("d", 256)  # after the cursor (768), not in the hole at 0
    assert d is not None and d.offset_bytes == 768
    e = ring.allocate("e", 200)  # tail is full: wraps to offset 0, reserves 256
    assert e is not None and (e.offset_bytes, e.reserved_bytes, e.size_bytes) == (0, 256, 200)


def test_oversized_allocation_names_the_needed_mib_and_changes_nothing() -> None:
    """Guards docs/failure-modes.md #6: a chunk larger than the ring fails only its own request."""
    ring = StagingRing(4 * MiB)
    held = ring.allocate("small", 1000)
    before = (ring.used_bytes, ring.live_regions, ring.owners(), ring.high_water_bytes)
    with pytest.raises(OversizedAllocation, match="at least 7 MiB") as info:
        ring.allocate("big", 6 * MiB + 1)  # 6 MiB + 1 byte needs a 7 MiB pool
    assert isinstance(info.value, RingError)
    assert (info.value.needed_bytes, info.value.capacity_bytes) == (6 * MiB + 1, 4 * MiB)
    assert (ring.used_bytes, ring.live_regions, ring.owners(), ring.high_water_bytes) == before
    assert ring.allocate("next", 1 * MiB) is not None  # the ring keeps serving
    assert held is not None and ring.free(held)


def test_double_free_is_a_reported_no_op() -> None:
    ring = StagingRing(2048)
    region = ring.allocate("a", 512)
    assert region is not None
    assert ring.free(region) is True
    again = ring.allocate("b", 512)  # reuses offset 0 under a new id
    assert again is not None and again.offset_bytes == region.offset_bytes
    assert ring.free(region) is False  # the stale handle must not free b's region
    assert ring.live_regions == 1 and ring.used_bytes == 512
    forged = Region(again.region_id, "b", again.offset_bytes, 256, 256)
    assert ring.free(forged) is False


def test_free_owner_releases_exactly_that_owners_regions_once() -> None:
    """Guards docs/failure-modes.md #4: an aborted request's regions must all come back, once."""
    ring = StagingRing(8192)
    mine = [ring.allocate("req-1", 1000) for _ in range(3)]
    other = ring.allocate("req-2", 1000)
    assert all(r is not None for r in mine) and other is not None
    assert ring.owners() == frozenset({"req-1", "req-2"})
    assert ring.free_owner("req-1") == 3
    assert ring.free_owner("req-1") == 0
    assert ring.owners() == frozenset({"req-2"})
    assert ring.used_bytes == 1024 and ring.regions_of("req-2") == (other,)
    # then 100 more requests go through the same ring; req-2 holds [3072, 4096), so the
    # largest free extent is [4096, 8192): 4000 bytes (4096 reserved) must always fit.
    for i in range(100):
        region = ring.allocate(f"later-{i}", 4000)
        assert region is not None
        assert ring.free(region)


def test_quarantined_region_is_not_reused_until_released() -> None:
    """Guards docs/failure-modes.md #16: a region a late write may land in must not be handed
    out."""
    ring = StagingRing(1024, alignment_bytes=256)
    stuck = ring.allocate("slow", 512)
    assert stuck is not None
    assert ring.quarantine(stuck)
    assert ring.free(stuck) is False and ring.free_owner("slow") == 0
    assert ring.owners() == frozenset() and ring.quarantined_bytes == 512
    assert ring.allocate("x", 1024) is None  # quarantined bytes are still occupied
    for _ in range(10):
        region = ring.allocate("y", 512)
        assert region is not None and region.offset_bytes != stuck.offset_bytes
        ring.free(region)
    assert ring.release_quarantined(stuck) == 1
    assert ring.release_quarantined() == 0
    assert ring.used_bytes == 0 and ring.allocate("x", 1024) is not None


def test_high_water_tracks_peak_and_resets_to_current() -> None:
    ring = StagingRing(4096)
    a = ring.allocate("a", 1024)
    b = ring.allocate("b", 2048)
    assert a is not None and b is not None
    ring.free(b)
    assert ring.high_water_bytes == 3072
    ring.reset_high_water()
    assert ring.high_water_bytes == 1024


def test_bad_construction_and_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="power of two"):
        StagingRing(1024, alignment_bytes=3)
    with pytest.raises(ValueError, match="multiple of the alignment"):
        StagingRing(1000)
    with pytest.raises(ValueError, match="positive"):
        StagingRing(1024).allocate("a", 0)


def _largest_free_run(occupancy: bytearray, alignment: int) -> int:
    best = run = 0
    for slot in range(0, len(occupancy), alignment):
        run = run + alignment if occupancy[slot] == 0 else 0
        best = max(best, run)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_every_invariant(seed: int) -> None:
    """Against a bytearray occupancy model, after every one of 3000 random operations:
    live regions never overlap and lie aligned in [0, capacity); used + free = capacity and
    used equals the model's occupied bytes; allocate returns None only when no free run
    fits; free/free_owner/quarantine release exactly what they report."""
    rng = random.Random(seed)
    alignment = 64
    capacity = alignment * rng.choice([16, 50, 128])
    ring = StagingRing(capacity, alignment_bytes=alignment)
    occupancy = bytearray(capacity)
    live: dict[int, Region] = {}
    quarantined: dict[int, Region] = {}
    freed: list[Region] = []
    owners = [f"req-{i}" for i in range(5)]

    def mark(region: Region, value: int) -> None:
        for i in range(region.offset_bytes, region.end_bytes):
            assert occupancy[i] == (0 if value else 1), "model overlap"
            occupancy[i] = value

    for _ in range(3000):
        op = rng.random()
        if op < 0.5:
            size = rng.randint(1, capacity // 3) if rng.random() < 0.9 else capacity
            owner = rng.choice(owners)
            largest = _largest_free_run(occupancy, alignment)
            region = ring.allocate(owner, size)
            needed = -(-size // alignment) * alignment
            if region is None:
                assert largest < needed
            else:
                assert region.offset_bytes % alignment == 0
                assert region.reserved_bytes == needed and region.size_bytes == size
                assert region.offset_bytes >= 0 and region.end_bytes <= capacity
                mark(region, 1)
                live[region.region_id] = region
        elif op < 0.75 and (live or freed):
            if freed and rng.random() < 0.2:
                assert ring.free(rng.choice(freed)) is False  # double free: no-op
            elif live:
                region = live.pop(rng.choice(list(live)))
                assert ring.free(region) is True
                mark(region, 0)
                freed.append(region)
        elif op < 0.85:
            owner = rng.choice(owners)
            mine = [r for r in live.values() if r.owner == owner]
            assert ring.free_owner(owner) == len(mine)
            for region in mine:
                del live[region.region_id]
                mark(region, 0)
                freed.append(region)
        elif op < 0.95 and live:
            region = live.pop(rng.choice(list(live)))
            assert ring.quarantine(region)
            quarantined[region.region_id] = region
        else:
            released = ring.release_quarantined()
            assert released == len(quarantined)
            for region in quarantined.values():
                mark(region, 0)
            quarantined.clear()

        used = sum(occupancy)
        assert ring.used_bytes == used
        assert ring.used_bytes + ring.free_bytes == capacity
        assert ring.live_regions == len(live)
        assert ring.quarantined_regions == len(quarantined)
        assert ring.largest_free_extent_bytes == _largest_free_run(occupancy, alignment)
        assert ring.owners() == frozenset(r.owner for r in live.values())
        assert ring.high_water_bytes >= used
        spans = sorted((r.offset_bytes, r.end_bytes) for r in [*live.values(),
                                                                 *quarantined.values()])
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start

    ring.release_quarantined()
    for owner in owners:
        ring.free_owner(owner)
    assert ring.used_bytes == 0 and ring.live_regions == 0
    assert ring.allocate("last", capacity) is not None  # empty again: whole ring fits



def test_shrink_keeps_the_start_frees_the_tail_and_voids_the_old_region() -> None:
    """A pre-granted region whose part filled only its start (decode/__init__.py)."""
    ring = StagingRing(4096, alignment_bytes=256)
    region = ring.allocate("room", 2048)
    assert region is not None
    kept = ring.shrink(region, 300)  # rounds up to 512 reserved
    assert kept is not None
    assert (kept.region_id, kept.offset_bytes, kept.size_bytes, kept.reserved_bytes) == (
        region.region_id, 0, 300, 512)
    assert ring.used_bytes == 512 and ring.largest_free_extent_bytes == 4096 - 512
    nxt = ring.allocate("other", 256)
    assert nxt is not None and nxt.offset_bytes == 512  # the cursor followed the new end
    assert ring.free(region) is False and ring.shrink(region, 100) is None  # stale
    with pytest.raises(ValueError, match="size_bytes"):
        ring.shrink(kept, 301)
    assert ring.free(kept) and ring.free(nxt) and ring.used_bytes == 0
