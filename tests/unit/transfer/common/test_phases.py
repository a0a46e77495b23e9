"""Phase stamps: what each endpoint records per part, the bounded log, and the latency split
``pd-transfer bench transfer`` computes from them.

Unit tests over the loopback transport (one manual clock, endpoints stepped by hand): no
NIXL, no GPU.
"""

from __future__ import annotations

from typing import Any

import pytest

from pd_testbed.transfer_harness import Cluster
from pd_transfer.bench.phases import STAGED_PHASES, compute_phases
from pd_transfer.common.phases import PartTimes, PhaseLog, RequestTimes, Stamp
from pd_transfer.kv.staging import staged_chunk_bytes
from pd_transfer.protocol.lifecycle import State

pytestmark = pytest.mark.timeout(60)

PREFILL_ORDER = [Stamp.GIVEN, Stamp.PICKED, Stamp.READY, Stamp.ALLOC_SENT, Stamp.GATHER_QUEUED,
                 Stamp.GATHER_ENQUEUED, Stamp.GRANTED, Stamp.GATHERED, Stamp.POSTED,
                 Stamp.WRITTEN]
DECODE_ORDER = [Stamp.ALLOC_RECEIVED, Stamp.GRANT_SENT, Stamp.NOTIFIED, Stamp.SCATTER_QUEUED,
                Stamp.SCATTERED]
# Part 0 written into its RequestKV's pre-grant: taking it is the grant.
PREFILL_PREGRANTED_ORDER = [Stamp.GIVEN, Stamp.PICKED, Stamp.READY, Stamp.PREGRANT_TAKEN,
                            Stamp.GATHER_QUEUED, Stamp.GATHER_ENQUEUED, Stamp.GATHERED,
                            Stamp.POSTED, Stamp.WRITTEN]
DECODE_PREGRANTED_ORDER = [Stamp.PREGRANTED, Stamp.NOTIFIED, Stamp.SCATTER_QUEUED,
                           Stamp.SCATTERED]


@pytest.mark.parametrize("pregrant", [False, True], ids=["asked", "pre-granted"])
def test_every_staged_part_is_stamped_in_order_on_both_sides(pregrant: bool) -> None:
    """The bench splits latency from these stamps: a missing or out-of-order one would
    misattribute time (2 -> 4 with 4 heads: 4 pairs, one part each)."""
    cluster = Cluster(prefill_tp=2, decode_tp=4, kv_heads=4, mode="staged",
                      pregrant_share=0.5 if pregrant else 0.0)
    prefill_order = PREFILL_PREGRANTED_ORDER if pregrant else PREFILL_ORDER
    decode_order = DECODE_PREGRANTED_ORDER if pregrant else DECODE_ORDER
    logs = {e.transport.agent_name: PhaseLog() for e in cluster.endpoints}
    for endpoint in cluster.endpoints:
        endpoint.phases = logs[endpoint.transport.agent_name]
    request = cluster.new_request(num_tokens=10)
    cluster.start(request)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == {State.SUCCEEDED}
    prefill = [logs[s.transport.agent_name].take(request.room) for s in cluster.senders]
    decode = [logs[r.transport.agent_name].take(request.room) for r in cluster.receivers]
    assert all(t is not None and t.state == "Succeeded" for t in prefill + decode)
    sent = [part.peer for t in prefill if t is not None for part in t.parts]
    assert len(sent) == 4 and len(set(sent)) == 4  # one part per decode rank
    layout = cluster.receivers[0].pool.layout
    for times in decode:
        assert times is not None and len(times.parts) == 1
        part = times.parts[0]
        assert (Stamp.ALLOC_RECEIVED in part.stamps) is not pregrant
        stamps = [part.stamps[s] for s in decode_order]
        assert stamps == sorted(stamps) and stamps[-1] <= times.finished
        # 2 layers x 3 pages (10 tokens, page 4) x 1 head of 4 x (4 x 2 bytes), K and V
        assert part.size_bytes == staged_chunk_bytes(layout, 2, 3, 1) == 2 * 2 * 3 * 4 * 8
        assert part.peer in {s.transport.agent_name for s in cluster.senders}
    for times in prefill:
        assert times is not None
        for part in times.parts:
            assert (Stamp.ALLOC_SENT in part.stamps) is not pregrant
            if pregrant:
                assert part.stamps[Stamp.GRANTED] == part.stamps[Stamp.PREGRANT_TAKEN]
            stamps = [part.stamps[s] for s in prefill_order]
            assert stamps == sorted(stamps), part.stamps
    assert all(len(log) == 0 for log in logs.values())  # taken: nothing left behind


def test_without_a_log_no_part_times_are_kept() -> None:
    cluster = Cluster(mode="staged")
    request = cluster.new_request(num_tokens=8)
    cluster.start(request)
    cluster.step()  # the commands ran: every endpoint holds the request
    transfers = [e._transfers[request.room] for e in cluster.endpoints]
    cluster.run(lambda: cluster.finished(request.room))
    assert all(t.part_times == [] for t in transfers)


def test_the_log_is_bounded_and_take_pops() -> None:
    log = PhaseLog(max_requests=2)
    for room in ("a", "b", "c"):
        log.add(RequestTimes(room, "decode", "Succeeded", 0.0, 1.0, ()))
    assert len(log) == 2 and log.take("a") is None  # the oldest went first
    assert log.take("b") is not None and log.take("b") is None
    with pytest.raises(ValueError, match="positive"):
        PhaseLog(max_requests=0)


def _times(peer: str, stamps: dict[Stamp, float], finished: float) -> dict[str, object]:
    part = PartTimes(peer, 0, 0, "staged", 1024, {str(k): v for k, v in stamps.items()})
    return {"created": 0.0, "finished": finished, "state": "Succeeded",
            "parts": [{"peer": part.peer, "sender_id": part.sender_id, "part": part.part,
                       "path": part.path, "size_bytes": part.size_bytes,
                       "stamps": dict(part.stamps)}]}


MS = 1e-3
START = 10.0


def _worked(pre_ms: dict[Stamp, float], dec_ms: dict[Stamp, float], prefill_done_ms: float,
            decode_done_ms: float) -> tuple[dict[str, Any], dict[str, float]]:
    """Phases of a one-part request whose stamps are given in ms after START, and their
    split rounded to µs, in ms."""
    agents = {("prefill", 0): "P", ("decode", 0): "D"}
    pre = {k: START + v * MS for k, v in pre_ms.items()}
    dec = {k: START + v * MS for k, v in dec_ms.items()}
    phases = compute_phases(START, {0: _times("D", pre, START + prefill_done_ms * MS)},
                            {0: _times("P", dec, START + decode_done_ms * MS)}, agents)
    split = {k: round(v / MS, 6) for k, v in phases["split_s"].items()}
    return phases, split


def test_staged_phases_follow_the_critical_path_and_add_up_to_the_latency() -> None:
    """Worked example (ms after start): the gather ends after the grant, so 'gather' is its
    exposed tail (2.5 - 2.0 = 0.5) and 'post' starts there."""
    phases, split = _worked(
        {Stamp.GIVEN: 0.0, Stamp.PICKED: 0.1, Stamp.READY: 0.1, Stamp.ALLOC_SENT: 0.3,
         Stamp.GATHER_QUEUED: 0.3, Stamp.GATHER_ENQUEUED: 0.4, Stamp.GRANTED: 2.0,
         Stamp.GATHERED: 2.5, Stamp.POSTED: 2.6, Stamp.WRITTEN: 3.0},
        {Stamp.ALLOC_RECEIVED: 1.0, Stamp.GRANT_SENT: 1.2, Stamp.NOTIFIED: 3.2,
         Stamp.SCATTER_QUEUED: 3.3, Stamp.SCATTERED: 4.0}, 5.0, 4.1)
    assert list(split) == list(STAGED_PHASES)
    assert split == {"pickup": 0.1, "prepare": 0.3, "grant wait": 1.6, "gather": 0.5,
                     "post": 0.1, "post → notification": 0.6, "scatter": 0.8,
                     "completion": 0.1}
    assert sum(phases["split_s"].values()) == pytest.approx(4.1 * MS)
    assert phases["critical"] == {"decode_rank": 0, "prefill_rank": 0, "part": 0,
                                  "size_bytes": 1024}
    assert phases["overlapped_s"]["grant round trip"] == pytest.approx(1.7 * MS)


def test_a_pre_granted_part_has_no_grant_wait_and_no_round_trip() -> None:
    """Worked example (ms after start): the pre-grant is taken at 0.3, so 'prepare' ends with
    the gather's enqueue at 0.4 and the gather's tail (0.4 → 0.9) follows at once."""
    phases, split = _worked(
        {Stamp.GIVEN: 0.0, Stamp.PICKED: 0.1, Stamp.READY: 0.1, Stamp.PREGRANT_TAKEN: 0.3,
         Stamp.GRANTED: 0.3, Stamp.GATHER_QUEUED: 0.3, Stamp.GATHER_ENQUEUED: 0.4,
         Stamp.GATHERED: 0.9, Stamp.POSTED: 1.0, Stamp.WRITTEN: 1.4},
        {Stamp.PREGRANTED: -1000.0, Stamp.NOTIFIED: 1.5, Stamp.SCATTER_QUEUED: 1.6,
         Stamp.SCATTERED: 2.0}, 3.0, 2.2)
    assert split == {"pickup": 0.1, "prepare": 0.3, "grant wait": 0.0, "gather": 0.5,
                     "post": 0.1, "post → notification": 0.5, "scatter": 0.5,
                     "completion": 0.2}
    assert sum(phases["split_s"].values()) == pytest.approx(2.2 * MS)
    assert "grant round trip" not in phases["overlapped_s"]
    assert phases["overlapped_s"]["gather enqueue"] == pytest.approx(0.1 * MS)
