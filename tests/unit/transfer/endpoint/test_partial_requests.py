"""Requests whose pages are not all known at once (chunked prefill registers pages as the
engine allocates them) or not all wanted (decode's own prefix cache holds the first ones).

Loopback transport, real sender/receiver state machines, bit-exact checks of decode's
pages against the seeded source.
"""

from __future__ import annotations

import pytest

from pd_testbed.transfer_harness import Cluster, Request
from pd_transfer.protocol.lifecycle import State
from pd_transfer.reference.kvdata import verify_pool

PAGE = 4
TOKENS = 30  # 8 pages, the last one partial


def verified_from(cluster: Cluster, request: Request, first_page: int) -> bool:
    """Decode's pages from ``first_page`` on hold the request's tokens from there."""
    kv = cluster.geometry.kv_geometry()
    skip = first_page * PAGE
    return all(
        verify_pool(r.pool, geometry=kv, parallelism=cluster.decode_par, coord=r.identity.coord,
                    pages=request.dst_pages[first_page:], source=request.source[:, :, skip:],
                    num_tokens=request.num_tokens - skip)
        for r in cluster.receivers)


def untouched(cluster: Cluster, pages: list[int]) -> bool:
    """Every byte of these decode pages is still zero (the pools start zeroed)."""
    return all(
        bool((r.pool.page_bytes(part, layer)[pages] == 0).all())
        for r in cluster.receivers for part in r.pool.layout.parts
        for layer in range(r.pool.layout.num_layers))


@pytest.mark.parametrize("decode_tp", [1, 2], ids=["contiguous", "staged"])
def test_decode_prefix_hit_receives_only_the_pages_it_lacks(decode_tp: int) -> None:
    cluster = Cluster(decode_tp=decode_tp, kv_heads=2, page_size=PAGE)
    request = cluster.new_request(TOKENS)
    for receiver in cluster.receivers:
        receiver.expect(request.room, request.dst_pages[3:], TOKENS, first_page=3)
    for sender in cluster.senders:  # prefill sends every page: it cannot know decode's hit
        sender.register_request(request.room, request.src_pages, TOKENS)
        sender.send_part(request.room, pages=range(0, 2))
        sender.send_part(request.room, pages=range(2, 8), last=True)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == {State.SUCCEEDED}
    assert verified_from(cluster, request, 3)
    assert untouched(cluster, request.dst_pages[:3])


def test_chunked_prefill_registers_pages_as_they_are_allocated() -> None:
    cluster = Cluster(page_size=PAGE)
    request = cluster.new_request(TOKENS)
    for receiver in cluster.receivers:
        receiver.expect(request.room, request.dst_pages, TOKENS)
    sender = cluster.senders[0]
    sender.register_request(request.room, request.src_pages[:3], TOKENS)
    sender.send_part(request.room, pages=range(0, 3))
    cluster.step()
    sender.extend_request(request.room, request.src_pages[3:6])
    sender.send_part(request.room, pages=range(3, 6))
    sender.extend_request(request.room, request.src_pages[6:])
    sender.send_part(request.room, pages=range(6, 8), last=True)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == {State.SUCCEEDED}
    assert cluster.verified(request)


def test_a_part_of_pages_not_registered_yet_is_refused() -> None:
    cluster = Cluster(page_size=PAGE)
    request = cluster.new_request(TOKENS)
    sender = cluster.senders[0]
    sender.register_request(request.room, request.src_pages[:3], TOKENS)
    future = sender.send_part(request.room, pages=range(0, 4))
    cluster.step()
    with pytest.raises(ValueError, match="not inside the request's 3 registered pages"):
        future.result(timeout=1)


def test_extending_past_the_request_or_repeating_a_page_is_refused() -> None:
    cluster = Cluster(page_size=PAGE)
    request = cluster.new_request(TOKENS)
    sender = cluster.senders[0]
    sender.register_request(request.room, request.src_pages[:7], TOKENS)
    too_many = sender.extend_request(request.room, [60, 61])
    repeated = sender.extend_request(request.room, [request.src_pages[0]])
    cluster.step()
    with pytest.raises(ValueError, match="7 \\+ 2 pages exceed the 8 its 30 tokens need"):
        too_many.result(timeout=1)
    with pytest.raises(ValueError, match="page ids must be distinct"):
        repeated.result(timeout=1)


def test_decode_page_count_that_disagrees_with_prefill_fails_both_sides() -> None:
    cluster = Cluster(page_size=PAGE)
    request = cluster.new_request(TOKENS)
    # first_page 2 + 7 pages = 9, but a 30-token request has 8: a peer that miscounts.
    cluster.receivers[0].expect(request.room, [*request.dst_pages[2:], 63], TOKENS,
                                first_page=2)
    sender = cluster.senders[0]
    sender.register_request(request.room, request.src_pages, TOKENS)
    sender.send_part(request.room, last=True)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == {State.FAILED}
    status = sender.poll(request.room)
    assert status is not None and "from page 2" in status.detail


def test_first_page_past_the_last_token_is_refused_by_expect() -> None:
    cluster = Cluster(page_size=PAGE)
    future = cluster.receivers[0].expect("r", [5], 8, first_page=2)
    cluster.step()
    with pytest.raises(ValueError, match="first_page 2 leaves none of the 8 tokens"):
        future.result(timeout=1)
