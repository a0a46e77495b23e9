"""``RankControl`` over a rank of either role through the endpoint surface both share: the
pod agent's resize reaches a decode rank's ring and a prefill rank's buffer, each taking its
own size from one ``AgentStaging``, and a written report restarts each staging's high-water
mark. Loopback transport, endpoints stepped by worker threads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from pd_contract.transferagent import AgentStaging
from pd_testbed.transfer_harness import TEST_AUTH, Cluster
from pd_transfer.endpoint import Endpoint
from pd_transfer.rank.worker import Worker
from pd_transfer.vllm.rank_control import (
    REPORTED_ROUTE,
    ControlRequest,
    RankControl,
    StagingReply,
    open_control,
    seal_control,
)

pytestmark = pytest.mark.timeout(60)


def control(endpoint: Endpoint[Any]) -> RankControl:
    return RankControl(endpoint, TEST_AUTH, live_requests=lambda: 0, probe=None,
                       transfer_timeout_s=5.0)


@contextmanager
def stepped(cluster: Cluster) -> Iterator[None]:
    workers = [Worker(e, f"test-{i}").start() for i, e in enumerate(cluster.endpoints)]
    try:
        yield
    finally:
        for worker in workers:
            worker.stop()


def test_one_staging_resizes_each_rank_to_its_own_size() -> None:
    cluster = Cluster(mode="staged")
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    staging = AgentStaging(decode_pool_mib=1, prefill_buffer_mib=2)
    with stepped(cluster):
        replies = [control(receiver).resize(staging), control(sender).resize(staging)]
    assert replies == [StagingReply(registration_version=2, side="ring"),
                       StagingReply(registration_version=2, side="buffer")]
    assert (receiver.ring.capacity_bytes, sender.staging.capacity_bytes) == (1 << 20, 2 << 20)


def test_a_written_report_restarts_the_high_water_marks() -> None:
    cluster = Cluster(mode="staged")
    request = cluster.new_request(num_tokens=16)
    cluster.start(request)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.verified(request)
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    assert receiver.ring.high_water_bytes > 0 and sender.staging.high_water_bytes > 0
    body = seal_control(ControlRequest(), TEST_AUTH, tp_rank=0, route=REPORTED_ROUTE,
                        reply=False)
    for endpoint in (receiver, sender):
        status, reply = control(endpoint).serve_reported(body)
        assert status == 200
        assert open_control(reply, StagingReply, TEST_AUTH, tp_rank=0, route=REPORTED_ROUTE,
                            reply=True) == StagingReply()
    assert (receiver.ring.high_water_bytes, sender.staging.high_water_bytes) == (0, 0)
    assert receiver.metrics.snapshot().ring.high_water_bytes == 0  # type: ignore[union-attr]
