"""The connector's worker side without vLLM: real sender/receiver state machines over the
loopback transport, real HTTP bootstrap fetches (to an address nobody listens on)."""

from __future__ import annotations

import socket
import time

import torch

from pd_contract.config import LayerPipelineConfig
from pd_testbed.transfer_harness import TEST_AUTH, Cluster
from pd_transfer.rank.pod_peers import PodConnections
from pd_transfer.vllm.rank import IDLE_WAIT_S, RankSide
from pd_transfer.vllm.steps import DecodeLoad, StepPlan

PIPELINE = LayerPipelineConfig(enabled=True, min_tokens=8, min_groups=2, max_groups=4,
                               saturation=4.0)


def decode_rank(cluster: Cluster) -> RankSide:
    receiver = cluster.receivers[0]
    connections = PodConnections([receiver], TEST_AUTH, cluster.geometry, timeout_s=2.0)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(cluster.layers)]
    return RankSide(receiver, connections, names, PIPELINE, device=torch.device("cpu"))


def wait_for(rank: RankSide, finished: set[str], timeout_s: float = 10.0) -> tuple[set[str],
                                                                                    set[str]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = rank.results(finished)
        if out.finished_recving or out.finished_sending:
            return out.finished_recving, out.failed_recving
        time.sleep(0.01)
    raise AssertionError("no result within the timeout")


def test_unreachable_prefill_fails_the_load_alone_with_its_blocks() -> None:
    cluster = Cluster()
    rank = decode_rank(cluster)
    try:
        rank.begin_step(StepPlan(loads=(DecodeLoad("req-1", "room-1", "127.0.0.1:1", 8, 0,
                                                   (5, 9)),)))
        rank.start_loads()  # returns at once: connecting runs off the forward thread
        recving, failed = wait_for(rank, set())
        assert (recving, failed) == ({"req-1"}, {"req-1"})
        assert rank.load_errors() == {5, 9}
        assert rank.load_errors() == set()  # reported once
        assert rank.live_requests() == 0
    finally:
        rank.close()


def test_a_load_vllm_allocated_too_few_blocks_for_fails_at_once() -> None:
    cluster = Cluster()
    rank = decode_rank(cluster)
    try:
        rank.begin_step(StepPlan(loads=(DecodeLoad("req-1", "room-1", "127.0.0.1:1", 9, 0,
                                                   (5, 9), "2 blocks for 3 pages"),)))
        rank.start_loads()
        out = rank.results(set())
        assert (out.finished_recving, out.failed_recving) == ({"req-1"}, {"req-1"})
    finally:
        rank.close()


def test_an_empty_step_waits_for_a_transfer_instead_of_returning_at_once() -> None:
    cluster = Cluster()
    rank = decode_rank(cluster)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers: a slow peer
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        rank.begin_step(StepPlan(loads=(DecodeLoad("req-1", "room-1", address, 8, 0,
                                                   (5, 9)),), forward=False))
        rank.start_loads()
        started = time.monotonic()
        rank.results(set())  # nothing finished within the wait: returns after IDLE_WAIT_S
        waited = time.monotonic() - started
        assert waited >= IDLE_WAIT_S * 0.9
        rank.begin_step(StepPlan(forward=True))
        started = time.monotonic()
        rank.results(set())  # a step with a forward never waits
        assert time.monotonic() - started < IDLE_WAIT_S
    finally:
        rank.close()
        silent.close()
