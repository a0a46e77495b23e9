"""Decode's scatter of a pre-granted region, prepared with the grant (decode/__init__.py),
over the loopback transport, stepped by hand.

When decode pre-grants a staged writer's part 0 the whole share of the request, it prepares
that share's scatter at once (ids on the device, arguments checked, the kernel bound), so
the StagedPart only launches it. Only a part that is the whole share may use it: any other
part (layers or pages of a layer-pipelined or chunked request), a part whose pre-grant went
back, or a part granted on request is prepared when its notification arrives. What these
tests pin: every request lands bit-exact whichever scatter ran (a prepared scatter used for
another part would unpack a differently shaped buffer), and which one ran.
"""

from __future__ import annotations

import pytest

from pd_testbed.transfer_harness import Cluster, Request
from pd_transfer.decode import DecodeReceiver
from pd_transfer.protocol.lifecycle import State

pytestmark = pytest.mark.timeout(60)


def _scatters(cluster: Cluster) -> list[tuple[int, int]]:
    """Per decode rank: (scatters prepared at the grant, at the notification)."""
    return [(_count(r, "grant"), _count(r, "notification")) for r in cluster.receivers]


def _count(receiver: DecodeReceiver, prepared: str) -> int:
    return int(receiver.metrics.scatters.labels(prepared)._value.get())


def _finish(cluster: Cluster, request: Request) -> None:
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == {State.SUCCEEDED}, cluster.statuses(request.room)
    assert cluster.verified(request)
    cluster.retire(request)


# (prefill TP, decode TP), 2 KV heads -> per decode rank, how many writers it has: 1 → 2
# gives each decode rank one of the prefill rank's heads; 2 → 1 has two writers into one.
@pytest.mark.parametrize(("tp", "writers"), [((1, 1), [1]), ((1, 2), [1, 1]), ((2, 1), [2])],
                         ids=["1to1", "1to2", "2to1"])
@pytest.mark.parametrize("pool", ["stacked", "vllm-cpu"])
def test_a_pre_granted_whole_request_is_scattered_as_prepared_with_the_grant(
    tp: tuple[int, int], writers: list[int], pool: str,
) -> None:
    """``vllm-cpu``: per-layer HND pools with K and V packed per head, as vLLM's CPU
    backend holds them (the torch path per layer, not the stacked pool's)."""
    shape = {"page_format": "hnd", "packing": "per_head"} if pool == "vllm-cpu" else {}
    cluster = Cluster(mode="staged", prefill_tp=tp[0], decode_tp=tp[1], **shape)  # type: ignore[arg-type]
    for _ in range(2):  # a second request reuses the ring's space
        request = cluster.new_request(num_tokens=10)
        cluster.start(request)
        _finish(cluster, request)
    assert _scatters(cluster) == [(2 * n, 0) for n in writers]
    cluster.assert_clean()


@pytest.mark.parametrize("split", ["pages", "layers"])
def test_parts_smaller_than_the_share_are_prepared_at_their_notification(split: str) -> None:
    """Two parts: part 0 lands in the front of the pre-granted region (its tail is freed),
    part 1 asks for its own. The whole share's prepared scatter is used by neither."""
    cluster = Cluster(mode="staged")
    sender = cluster.senders[0]
    request = cluster.new_request(num_tokens=16)
    cluster.start(request, send=False)
    cluster.run(lambda: sender.debug_counts()["transfers"] == 1)
    if split == "pages":
        half = len(request.src_pages) // 2
        sender.send_part(request.room, pages=range(half))
        sender.send_part(request.room, pages=range(half, len(request.src_pages)), last=True)
    else:
        sender.send_part(request.room, layers=range(1))
        sender.send_part(request.room, layers=range(1, cluster.layers), last=True)
    _finish(cluster, request)
    assert _scatters(cluster) == [(0, 2)]
    assert (sender.pregrants_taken, sender.alloc_requests_sent) == (1, 1)
    cluster.assert_clean()


def test_a_pre_grant_withdrawn_by_a_resize_is_not_scattered_as_prepared() -> None:
    """The ring is resized while prefill computes: the pre-grant (and the scatter prepared
    for it, a view of the old ring) goes back, and the part asks in the new ring."""
    cluster = Cluster(mode="staged", ring_bytes=8192)
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: sender.debug_counts()["transfers"] == 1)
    future = receiver.resize_bytes(16384, deadline_s=30.0)
    cluster.run(future.done)
    assert future.result().failed_requests == 0 and receiver.ring_version == 2
    sender.send_part(request.room, last=True)
    _finish(cluster, request)
    assert _scatters(cluster) == [(0, 1)]
    assert (sender.pregrants_taken, sender.alloc_requests_sent) == (0, 1)
    cluster.assert_clean()


def test_without_pre_grants_every_scatter_is_prepared_at_its_notification() -> None:
    cluster = Cluster(mode="staged", decode_tp=2, pregrant_share=0.0)
    request = cluster.new_request(num_tokens=8)
    cluster.start(request)
    _finish(cluster, request)
    assert _scatters(cluster) == [(0, 1), (0, 1)]
    cluster.assert_clean()
