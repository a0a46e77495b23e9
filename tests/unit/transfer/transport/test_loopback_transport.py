"""The loopback transport keeps the Transport contract; needs neither NIXL nor a GPU."""

from __future__ import annotations

import pytest
import torch

from pd_transfer.errors import (
    DescriptorError,
    DescriptorOutOfBounds,
    PeerUnreachable,
    RegistrationError,
    TransportError,
)
from pd_transfer.transport import (
    FaultAction,
    FaultRule,
    LoopbackFabric,
    LoopbackTransport,
    ManualClock,
    RegisteredRegion,
    TransferHandle,
    TransferState,
    Transport,
)

pytestmark = pytest.mark.timeout(10)

KIB = 1024


class Pair:
    """A prefill agent with a 64 KiB source and a decode agent with a 64 KiB landing buffer."""

    def __init__(self, fabric: LoopbackFabric) -> None:
        self.fabric = fabric
        self.prefill = fabric.create("prefill-0")
        self.decode = fabric.create("decode-0")
        self.src = torch.arange(64 * KIB, dtype=torch.int32).to(torch.uint8)
        self.dst = torch.zeros(64 * KIB, dtype=torch.uint8)
        self.src_region = self.prefill.register(self.src, name="src")
        self.dst_region = self.decode.register(self.dst, name="dst")
        assert self.prefill.add_peer(self.decode.local_metadata(),
                                     expected_name="decode-0") == "decode-0"
        assert self.decode.add_peer(self.prefill.local_metadata(),
                                     expected_name="prefill-0") == "prefill-0"

    def spans(self, count: int, size: int, stride: int) -> tuple[list[tuple[int, int]], ...]:
        """``count`` scattered spans: source offset i*stride → destination offset i*size."""
        local = [(self.src_region.base_address + i * stride, size) for i in range(count)]
        remote = [(self.dst_region.base_address + i * size, size) for i in range(count)]
        return local, remote

    def write(self, count: int = 4, note: bytes = b"chunk") -> TransferHandle:
        local, remote = self.spans(count, KIB, 2 * KIB)
        return self.prefill.write("decode-0", local, remote, [self.dst_region], note)

    def expected(self, count: int, size: int = KIB, stride: int = 2 * KIB) -> torch.Tensor:
        return torch.cat([self.src[i * stride : i * stride + size] for i in range(count)])


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def pair(clock: ManualClock) -> Pair:
    return Pair(LoopbackFabric(clock))


def test_loopback_satisfies_the_transport_protocol(pair: Pair) -> None:
    """A second implementation must fit the same Protocol the NIXL one does."""
    assert isinstance(pair.prefill, Transport)


def test_many_descriptors_land_bit_exact_and_notification_follows_data(pair: Pair) -> None:
    """Guards docs/failure-modes.md #9: the notification is the proof of arrival, never earlier."""
    local, remote = pair.spans(32, KIB, 2 * KIB)
    handle = pair.prefill.write("decode-0", local, remote, [pair.dst_region], b"req-1")
    # Posted, not yet progressed: nothing landed and nothing was announced.
    assert pair.dst.count_nonzero() == 0
    assert pair.decode._inbox == []

    assert pair.decode.poll_messages() == [("prefill-0", b"req-1")]
    assert torch.equal(pair.dst[: 32 * KIB], pair.expected(32))
    assert pair.dst[32 * KIB :].count_nonzero() == 0  # nothing outside the 32 spans
    assert pair.prefill.state(handle) is TransferState.DONE
    stats = pair.prefill.stats
    assert (stats.transfers_posted, stats.descriptors_posted, stats.bytes_posted) == (
        1,
        32,
        32 * KIB,
    )
    pair.prefill.release(handle)
    pair.prefill.release(handle)  # idempotent


def test_control_messages_flow_both_ways_in_order(pair: Pair) -> None:
    pair.prefill.send_message("decode-0", b"hello")
    pair.prefill.send_message("decode-0", b"again")
    pair.decode.send_message("prefill-0", b"grant")
    assert pair.decode.poll_messages() == [("prefill-0", b"hello"), ("prefill-0", b"again")]
    assert pair.prefill.poll_messages() == [("decode-0", b"grant")]
    assert pair.decode.poll_messages() == []


@pytest.mark.parametrize(
    ("local_offset", "remote_offset", "length"),
    [
        (64 * KIB - 512, 0, KIB),  # local span runs past the source region by 512 bytes
        (0, 64 * KIB - 512, KIB),  # remote span runs past the granted region
        (0, -KIB, KIB),  # remote span entirely before the granted region
    ],
)
def test_out_of_bounds_descriptor_is_rejected_before_posting(
    pair: Pair, local_offset: int, remote_offset: int, length: int
) -> None:
    """Guards docs/failure-modes.md #15: no read or write outside registered/granted memory."""
    local = [
        (pair.src_region.base_address, KIB),
        (pair.src_region.base_address + local_offset, length),
    ]
    remote = [
        (pair.dst_region.base_address, KIB),
        (pair.dst_region.base_address + remote_offset, length),
    ]
    with pytest.raises(DescriptorOutOfBounds, match="descriptor #1"):
        pair.prefill.write("decode-0", local, remote, [pair.dst_region], b"x")
    assert pair.prefill.stats.transfers_posted == 0
    assert pair.decode.poll_messages() == []
    assert pair.dst.count_nonzero() == 0


def test_remote_span_is_checked_against_the_granted_region_only(pair: Pair) -> None:
    """A grant of the first 4 KiB does not license writing the rest of the peer's buffer."""
    grant = RegisteredRegion("dst", pair.dst_region.base_address, 4 * KIB, pair.dst_region.kind, 0)
    local, remote = [(pair.src_region.base_address, KIB)], [(grant.base_address + 4 * KIB, KIB)]
    with pytest.raises(DescriptorOutOfBounds, match="region the peer granted"):
        pair.prefill.write("decode-0", local, remote, [grant], b"x")


@pytest.mark.parametrize(
    ("local_lengths", "remote_lengths"),
    [([], []), ([KIB], [KIB, KIB]), ([KIB], [512]), ([0], [0])],
)
def test_malformed_descriptor_lists_are_refused(
    pair: Pair, local_lengths: list[int], remote_lengths: list[int]
) -> None:
    local = [(pair.src_region.base_address, n) for n in local_lengths]
    remote = [(pair.dst_region.base_address, n) for n in remote_lengths]
    with pytest.raises(DescriptorError):
        pair.prefill.write("decode-0", local, remote, [pair.dst_region], b"x")
    assert pair.prefill.stats.descriptors_posted == 0


def test_write_into_memory_deregistered_after_the_grant_fails_like_a_nic(pair: Pair) -> None:
    """The granted region was valid at post time; the NIC-level check at execution refuses."""
    handle = pair.write()
    pair.decode.deregister(pair.dst_region)
    assert pair.prefill.state(handle) is TransferState.FAILED
    assert pair.dst.count_nonzero() == 0
    assert pair.decode.poll_messages() == []
    assert pair.prefill.stats.transfers_failed == 1


def test_dropped_notification_leaves_data_but_no_proof(pair: Pair) -> None:
    rule = pair.fabric.inject(FaultRule(FaultAction.DROP, lambda e: e.kind == "transfer"))
    handle = pair.write(count=2)
    assert pair.prefill.state(handle) is TransferState.DONE
    assert torch.equal(pair.dst[: 2 * KIB], pair.expected(2))
    assert pair.decode.poll_messages() == []
    assert rule.applied == 1
    pair.prefill.send_message("decode-0", b"status")  # the rule is used up: delivered
    assert pair.decode.poll_messages() == [("prefill-0", b"status")]


def test_dropped_control_message_is_never_delivered(pair: Pair) -> None:
    pair.fabric.inject(FaultRule(FaultAction.DROP, lambda e: e.payload == b"grant"))
    pair.decode.send_message("prefill-0", b"grant")
    pair.decode.send_message("prefill-0", b"other")
    assert pair.prefill.poll_messages() == [("decode-0", b"other")]


def test_delay_holds_data_and_notification_until_the_clock_passes(
    pair: Pair, clock: ManualClock
) -> None:
    pair.fabric.inject(FaultRule(FaultAction.DELAY, delay_s=0.5))
    handle = pair.write()
    clock.advance(0.4)
    assert pair.prefill.state(handle) is TransferState.PENDING
    assert pair.decode.poll_messages() == []
    assert pair.dst.count_nonzero() == 0
    clock.advance(0.1)
    assert pair.decode.poll_messages() == [("prefill-0", b"chunk")]
    assert pair.prefill.state(handle) is TransferState.DONE


def test_failed_transfer_writes_nothing_and_sends_no_notification(pair: Pair) -> None:
    pair.fabric.inject(FaultRule(FaultAction.FAIL, lambda e: e.payload == b"doomed"))
    handle = pair.write(note=b"doomed")
    assert pair.prefill.state(handle) is TransferState.FAILED
    assert pair.decode.poll_messages() == []
    assert pair.dst.count_nonzero() == 0
    assert pair.prefill.stats.transfers_failed == 1
    ok = pair.write(note=b"fine")
    assert pair.prefill.state(ok) is TransferState.DONE


def test_release_of_a_pending_transfer_aborts_it(pair: Pair, clock: ManualClock) -> None:
    pair.fabric.inject(FaultRule(FaultAction.DELAY, delay_s=1.0))
    handle = pair.write()
    pair.prefill.release(handle)
    clock.advance(2.0)
    assert pair.decode.poll_messages() == []
    assert pair.dst.count_nonzero() == 0
    with pytest.raises(TransportError, match="released"):
        pair.prefill.state(handle)


def test_killed_peer_is_unreachable_and_its_inflight_transfer_fails(
    pair: Pair, clock: ManualClock
) -> None:
    """Guards docs/failure-modes.md #19: a dead peer surfaces as an error, not a hang."""
    pair.fabric.inject(FaultRule(FaultAction.DELAY, delay_s=1.0))
    inflight = pair.write()
    pair.fabric.kill("decode-0")
    clock.advance(2.0)
    assert pair.prefill.state(inflight) is TransferState.FAILED
    with pytest.raises(PeerUnreachable, match="decode-0"):
        pair.write()
    with pytest.raises(PeerUnreachable):
        pair.prefill.send_message("decode-0", b"ping")
    with pytest.raises(TransportError, match="closed"):
        pair.decode.poll_messages()


def test_restarted_peer_is_a_new_incarnation(pair: Pair) -> None:
    """Guards docs/failure-modes.md #10: stale metadata never reaches a restarted process."""
    pair.fabric.kill("decode-0")
    reborn = pair.fabric.create("decode-0")
    with pytest.raises(PeerUnreachable, match="incarnation"):
        pair.prefill.send_message("decode-0", b"hello")
    pair.prefill.add_peer(reborn.local_metadata(), expected_name="decode-0")
    pair.prefill.send_message("decode-0", b"hello")
    assert reborn.poll_messages() == [("prefill-0", b"hello")]


def test_unknown_peer_and_removed_peer_are_unreachable(pair: Pair) -> None:
    with pytest.raises(PeerUnreachable, match="not added"):
        pair.prefill.send_message("nobody", b"x")
    pair.prefill.remove_peer("decode-0")
    pair.prefill.remove_peer("decode-0")  # idempotent
    with pytest.raises(PeerUnreachable):
        pair.write()


def test_registration_refuses_overlap_duplicates_and_strided_tensors(pair: Pair) -> None:
    with pytest.raises(RegistrationError, match="overlaps"):
        pair.prefill.register(pair.src[100:200], name="inner")
    with pytest.raises(RegistrationError, match="already registered"):
        pair.prefill.register(torch.zeros(8, dtype=torch.uint8), name="src")
    with pytest.raises(RegistrationError, match="contiguous"):
        pair.prefill.register(torch.zeros(8, 8)[:, 0])
    with pytest.raises(TransportError, match="not loopback metadata"):
        pair.prefill.add_peer(b"garbage", expected_name="decode-0")


def test_close_is_idempotent_and_frees_everything(pair: Pair) -> None:
    pair.prefill.close()
    pair.prefill.close()
    with pytest.raises(TransportError, match="closed"):
        pair.prefill.register(torch.zeros(8))
    with pytest.raises(PeerUnreachable):
        pair.decode.send_message("prefill-0", b"x")
    assert isinstance(pair.decode, LoopbackTransport)


def test_a_prepared_write_reads_the_source_at_its_post_and_posts_once(pair: Pair) -> None:
    """``prepare_write`` checks and builds; ``post`` sends what the source holds then, once.
    A discarded one, or one whose peer was reloaded or removed, never posts."""
    local, remote = pair.spans(2, KIB, 2 * KIB)
    prepared = pair.prefill.prepare_write("decode-0", local, remote, [pair.dst_region], b"p")
    unused = pair.prefill.prepare_write("decode-0", local, remote, [pair.dst_region], b"u")
    assert pair.prefill.stats.transfers_posted == 0
    pair.src[:KIB] = 7  # written after the prepare
    pair.prefill.discard(unused)
    pair.prefill.discard(unused)  # idempotent
    handle = pair.prefill.post(prepared)
    assert pair.decode.poll_messages() == [("prefill-0", b"p")]
    assert pair.prefill.state(handle) is TransferState.DONE
    assert torch.equal(pair.dst[:2 * KIB], pair.expected(2)) and pair.dst[0] == 7
    for spent in (prepared, unused):
        with pytest.raises(TransportError, match="posted or discarded"):
            pair.prefill.post(spent)
    for forget in (lambda: pair.prefill.add_peer(pair.decode.local_metadata(),
                                                 expected_name="decode-0"),  # a reload
                   lambda: pair.prefill.remove_peer("decode-0")):
        orphan = pair.prefill.prepare_write("decode-0", local, remote, [pair.dst_region], b"o")
        forget()
        with pytest.raises(TransportError, match="posted or discarded"):
            pair.prefill.post(orphan)
    assert pair.prefill.stats.transfers_posted == 1 and pair.decode.poll_messages() == []


def test_a_prepared_write_checks_bounds_and_peer_before_anything_is_built(pair: Pair) -> None:
    local, remote = pair.spans(1, KIB, KIB)
    with pytest.raises(DescriptorOutOfBounds):
        pair.prefill.prepare_write("decode-0", local, [(pair.dst_region.end_address, KIB)],
                                   [pair.dst_region], b"x")
    with pytest.raises(PeerUnreachable):
        pair.prefill.prepare_write("nobody", local, remote, [pair.dst_region], b"x")
    assert pair.prefill._prepared == {}
