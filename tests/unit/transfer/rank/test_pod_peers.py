"""Connecting to peer pods: a pod that restarted at the same address is connected anew and
its old incarnation dropped. Real sender/receiver endpoints on the loopback transport, each
stepped by its own worker thread, and a real bootstrap HTTP server (no NIXL needed: what is
tested is which peers each endpoint knows)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pd_testbed.transfer_harness import TEST_AUTH, Cluster
from pd_transfer.decode import DecodeReceiver
from pd_transfer.endpoint import RankIdentity
from pd_transfer.kv.plan import RankCoord
from pd_transfer.rank.pod_peers import RECHECK_S, PodConnections
from pd_transfer.rank.worker import Worker
from pd_transfer.trust.bootstrap import BootstrapServer, RankDocument


class Restartable:
    """The bootstrap server of one decode pod address whose receiver can be replaced (the
    pod restarted: same address, new agent)."""

    def __init__(self, receiver: DecodeReceiver) -> None:
        self.receiver = receiver
        self.server = BootstrapServer(self.render, TEST_AUTH)

    def render(self) -> RankDocument:
        return self.receiver.document()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    cluster = Cluster(host="127.0.0.1")  # documents are fetched over HTTP
    workers = [Worker(e, max_idle_sleep_s=0.001).start() for e in cluster.endpoints]
    try:
        yield cluster
    finally:
        for worker in workers:
            worker.stop(close=False)


def test_a_pod_restarted_at_the_same_address_is_connected_anew(cluster: Cluster) -> None:
    """Guards against a prefill that keeps talking to a decode pod's dead incarnation: its
    new agent's every message is refused as coming from an unknown peer until the request
    times out (seen with vLLM: a decode pod restarted by its kubelet never served again)."""
    sender, old = cluster.senders[0], cluster.receivers[0]
    pod = Restartable(old)
    now = [100.0]
    connections = PodConnections([sender], TEST_AUTH, cluster.geometry, timeout_s=2.0,
                                 clock=lambda: now[0])
    try:
        assert [d.agent_name for d in connections.connect(pod.server.address, "decode")] == [
            old.transport.agent_name]
        # The pod restarts: a new receiver (a new agent) behind the same address.
        new = DecodeReceiver(cluster.fabric.create("decode-0-0-restarted@127.0.0.1"), old.pool,
                             RankIdentity("d0", RankCoord(0, 0), cluster.decode_par,
                                          cluster.geometry),
                             auth=TEST_AUTH, ring_bytes=cluster.ring_bytes,
                             timeouts=cluster.timeouts, clock=cluster.clock)
        worker = Worker(new, max_idle_sleep_s=0.001).start()
        pod.receiver = new
        try:
            # Within RECHECK_S the cached documents are trusted (no fetch per request)...
            now[0] += RECHECK_S / 2
            assert connections.connect(pod.server.address, "decode")[0].agent_name == (
                old.transport.agent_name)
            # ...after it, the new incarnation is found, connected, and the old one dropped.
            now[0] += RECHECK_S
            docs = connections.connect(pod.server.address, "decode")
            assert [d.agent_name for d in docs] == [new.transport.agent_name]
            assert new.transport.agent_name in sender.peers
            assert old.transport.agent_name not in sender.peers
            # An unchanged pod is re-checked and kept.
            now[0] += RECHECK_S * 2
            assert connections.connect(pod.server.address, "decode") == docs
        finally:
            worker.stop()
    finally:
        pod.server.close()
