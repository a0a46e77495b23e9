"""The connector's worker side without vLLM, both halves (``DecodeRankSide``,
``PrefillRankSide``): real sender/receiver state machines over the loopback transport, real
HTTP bootstrap fetches (to an address nobody listens on)."""

from __future__ import annotations

import socket
import time

import torch

from pd_contract.config import LayerPipelineConfig
from pd_testbed.transfer_harness import TEST_AUTH, Cluster
from pd_transfer.protocol.lifecycle import FailureReason
from pd_transfer.rank.pod_peers import PodConnections
from pd_transfer.vllm.decode_rank import DecodeRankSide
from pd_transfer.vllm.prefill_rank import PrefillRankSide
from pd_transfer.vllm.rank import IDLE_WAIT_S
from pd_transfer.vllm.steps import DecodeLoad, PrefillChunk, StepPlan

PIPELINE = LayerPipelineConfig(enabled=True, min_tokens=8, min_groups=2, max_groups=4,
                               saturation=4.0)


def decode_rank(cluster: Cluster) -> DecodeRankSide:
    receiver = cluster.receivers[0]
    connections = PodConnections([receiver], TEST_AUTH, cluster.geometry, timeout_s=2.0)
    return DecodeRankSide(receiver, connections)


def prefill_rank(cluster: Cluster) -> PrefillRankSide:
    sender = cluster.senders[0]
    connections = PodConnections([sender], TEST_AUTH, cluster.geometry, timeout_s=2.0)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(cluster.layers)]
    return PrefillRankSide(sender, connections, names, PIPELINE, device=torch.device("cpu"))


def wait_for(rank: DecodeRankSide, finished: set[str], timeout_s: float = 10.0
             ) -> tuple[set[str], set[str]]:
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


def test_a_send_whose_decode_is_unreachable_ends_once_vllm_finished_it() -> None:
    """Prefill registers the request on its first chunk and connects to decode off the
    forward thread; decode cannot be reached, so the request fails alone (aborted on the
    sender) and is reported as a send, only once vLLM finished it (its blocks are held until
    then)."""
    cluster = Cluster()
    rank = prefill_rank(cluster)
    sender = cluster.senders[0]
    chunk = PrefillChunk("req-1", "room-1", "127.0.0.1:1", num_prompt_tokens=8, token_start=0,
                         token_stop=8, page_start=0, page_stop=2, new_pages=(3, 4))
    try:
        rank.begin_step(StepPlan(chunks=(chunk,)))
        for layer in range(cluster.layers):
            rank.layer_saved(f"model.layers.{layer}.self_attn.attn")
        rank.end_step()
        deadline = time.monotonic() + 10.0
        while rank.live_requests() and time.monotonic() < deadline:
            cluster.step()
            out = rank.results(set())
            assert not out.finished_sending  # vLLM has not finished it: its blocks are held
            status = sender.poll("room-1")
            if status is not None and status.finished:
                break
            time.sleep(0.01)
        status = sender.poll("room-1")
        assert status is not None and status.reason is FailureReason.ABORTED
        out = rank.results({"req-1"})
        assert (out.finished_sending, out.finished_recving) == ({"req-1"}, set())
        assert rank.live_requests() == 0 and rank.load_errors() == set()
    finally:
        rank.close()
