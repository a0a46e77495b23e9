"""Property: legitimate and hostile traffic, randomly interleaved, never breaks the protocol.

One prefill and one decode endpoint on the loopback fabric with a manual clock. Hypothesis
draws the path, the requests and how the engine splits them into parts, message drops and
delays (which also reorder), and a schedule of hostile messages from authenticated peers:
forged part indices and coverage, wrong sizes, out-of-region ring offsets, early final
counts, replays, garbage, nested JSON, unauthenticated bytes. Whatever happens:

- every request ends (Succeeded or Failed) on both sides within its deadlines;
- every per-request structure returns to its baseline once grace periods pass;
- no byte of decode's ring outside a region it granted, and no page outside the requests'
  destination pages, changes (guard pattern);
- decode's Succeeded implies bit-exact KV.

Bounded (``max_examples``, per-example ``deadline``), derandomized for CI. ``TALLY`` counts
cases, injected messages and outcomes for reports; the test prints nothing.
"""

from __future__ import annotations

import collections
import itertools
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_testbed.transfer_harness import TEST_AUTH, Cluster, Request, seal_as
from pd_transfer.kv.ring import Region
from pd_transfer.protocol.lifecycle import State
from pd_transfer.protocol.messages import (
    PROTOCOL_VERSION,
    AllocRequest,
    Finish,
    Grant,
    Message,
    PartDone,
    RequestKV,
    StagedPart,
)
from pd_transfer.transport import Envelope, FaultAction, FaultRule
from pd_transfer.trust.auth import Purpose

pytestmark = pytest.mark.timeout(120)

PREFILL, DECODE = "prefill-0-0", "decode-0-0"
GUARD = 0xA5
TICK_S = 0.05
HOSTILE_KINDS = ("garbage", "unsealed", "nested", "forged_part", "early_final", "alloc",
                 "replay", "to_prefill", "early_request_kv")
TALLY: collections.Counter[str] = collections.Counter()


@dataclass(frozen=True)
class Scenario:
    mode: str
    requests: list[tuple[int, int]]  # (num_tokens, parts the engine splits it into)
    hostile: list[tuple[int, str, int]]  # (round, kind, seed)
    seed: int
    drop: float
    delay: float


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    return Scenario(
        mode=draw(st.sampled_from(["staged", "sliced", "contiguous"])),
        requests=draw(st.lists(st.tuples(st.integers(1, 24), st.integers(1, 3)),
                               min_size=1, max_size=3)),
        hostile=draw(st.lists(st.tuples(st.integers(0, 60), st.sampled_from(HOSTILE_KINDS),
                                        st.integers(0, 2**32)), max_size=20)),
        seed=draw(st.integers(0, 2**32)),
        drop=draw(st.sampled_from([0.0, 0.0, 0.03, 0.15])),
        delay=draw(st.sampled_from([0.0, 0.1, 0.4])),
    )


def _sealed(sender: str, receiver: str, body: bytes) -> bytes:
    return TEST_AUTH.seal(body, purpose=Purpose.MESSAGE, version=PROTOCOL_VERSION,
                          sender=sender, receiver=receiver)


def _forged_part(mode: str, room: str, ticket: int, rng: random.Random,
                 ring_bytes: int) -> Message:
    """A notification that is wrong by construction: its part index (>= 100) was never
    a real part, so it can never complete a request (it either fails it or is refused)."""
    part, layers = 100 + rng.randrange(50), rng.choice([(0, 1), (0, 2), (1, 2), (1, 3)])
    pages = rng.randrange(0, 7), rng.randrange(1, 4)
    final = rng.choice([None, 1, 2, 200])
    if mode == "staged":
        return StagedPart(room=room, ticket=ticket, part=part, sender_id=0,
                          ring_offset=rng.choice([0, rng.randrange(2 * ring_bytes)]),
                          size_bytes=rng.choice([3, 512, 1024, ring_bytes + 1]),
                          layer_start=layers[0], layer_stop=layers[1], page_start=pages[0],
                          page_count=pages[1], ring_version=1, final_parts=final)
    return PartDone(room=room, ticket=ticket, part=part, sender_id=0, layer_start=layers[0],
                    layer_stop=layers[1], page_start=pages[0], page_count=pages[1],
                    final_parts=final)


def _inject(cluster: Cluster, scenario: Scenario, hostile: tuple[str, int], rooms: list[str],
            captured: list[bytes]) -> None:
    kind, seed = hostile
    rng = random.Random(seed)
    room = rng.choice(rooms)
    prefill, decode = cluster.senders[0].transport, cluster.receivers[0].transport
    # The live request's ticket where there is one, so a forgery meets the checks past it.
    to_decode = cluster.receivers[0].request_tickets(room).get(PREFILL, rng.randrange(1, 99))
    to_prefill = cluster.senders[0].request_tickets(room).get(DECODE, rng.randrange(1, 99))
    if kind == "garbage":
        decode_bound = _sealed(PREFILL, DECODE, rng.randbytes(rng.randrange(1, 200)))
        prefill.send_message(DECODE, decode_bound)
    elif kind == "unsealed":
        prefill.send_message(DECODE, rng.randbytes(rng.randrange(1, 200)))
    elif kind == "nested":
        prefill.send_message(DECODE, _sealed(PREFILL, DECODE, b"[" * rng.randrange(5, 3000)))
    elif kind == "forged_part":
        message = _forged_part(scenario.mode, room, to_decode, rng, cluster.ring_bytes)
        prefill.send_message(DECODE, seal_as(PREFILL, DECODE, message))
    elif kind == "early_final":
        message = Finish(room=room, ticket=to_decode, sender_id=0,
                         final_parts=rng.randrange(1, 4))
        prefill.send_message(DECODE, seal_as(PREFILL, DECODE, message))
    elif kind == "alloc":
        message = AllocRequest(room=room, ticket=to_decode, part=100 + rng.randrange(50),
                               sender_id=0,
                               size_bytes=rng.choice([1, 512, cluster.ring_bytes * 2]))
        prefill.send_message(DECODE, seal_as(PREFILL, DECODE, message))
    elif kind == "replay" and captured:
        prefill.send_message(DECODE, rng.choice(captured))
    elif kind == "to_prefill":
        grant = Grant(room=room, ticket=to_prefill, part=100 + rng.randrange(50), sender_id=0,
                      ring_offset=rng.randrange(2 * cluster.ring_bytes), size_bytes=512,
                      ring_version=1)
        body = rng.choice([seal_as(DECODE, PREFILL, grant),
                           _sealed(DECODE, PREFILL, b'{"v":' * 100)])
        decode.send_message(PREFILL, body)
    elif kind == "early_request_kv":
        message = RequestKV(room=f"ghost-{seed % 7}", ticket=1_000_000 + seed % 100_000,
                            decode_pp_rank=0, decode_tp_rank=0,
                            dst_page_runs=((0, 1),), num_tokens=1, path="staged",
                            ring_version=1)
        decode.send_message(PREFILL, seal_as(DECODE, PREFILL, message))
    else:
        return
    TALLY["injected"] += 1
    TALLY[f"injected:{kind}"] += 1


def _start(cluster: Cluster, request: Request, parts: int) -> None:
    cluster.receivers[0].expect(request.room, request.dst_pages, request.num_tokens)
    sender = cluster.senders[0]
    sender.register_request(request.room, request.src_pages, request.num_tokens)
    pages = len(request.src_pages)
    cuts = sorted({0, pages, *(round(pages * i / parts) for i in range(1, parts))})
    for start, stop in itertools.pairwise(cuts):
        sender.send_part(request.room, pages=range(start, stop), last=stop == pages)


@settings(max_examples=120, deadline=3000, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario=scenarios())
def test_hostile_interleavings_end_in_time_restore_baseline_and_never_corrupt(
    scenario: Scenario,
) -> None:
    """docs/failure-modes.md #27, #28 (also #3, #11): a hostile peer once found a message
    that skipped deadlines, notifications that completed requests without their data, and
    decoder crashes; random interleavings of such messages with real traffic must leave
    every request ended in time, every structure at baseline and the memory unharmed."""
    TALLY["cases"] += 1
    cluster = Cluster(mode=scenario.mode, tick_s=TICK_S)  # type: ignore[arg-type]
    receiver = cluster.receivers[0]
    baseline = cluster.counts()
    receiver.ring_buffer.fill_(GUARD)
    pool_guard = [t.view(torch.uint8).fill_(GUARD).clone() for t in receiver.pool.tensors()]
    granted: list[Region] = []  # every region the ring handed out (grants and pre-grants)
    allocate = receiver.ring.allocate

    def recording_allocate(owner: str, size_bytes: int) -> Region | None:
        region = allocate(owner, size_bytes)
        if region is not None:
            granted.append(region)
        return region

    receiver.ring.allocate = recording_allocate  # type: ignore[method-assign]
    captured: list[bytes] = []
    rng = random.Random(scenario.seed)

    def observe(envelope: Envelope) -> bool:
        if envelope.src == PREFILL and len(captured) < 64:
            captured.append(envelope.payload)
        return False

    cluster.fabric.inject(FaultRule(FaultAction.DROP, observe, remaining=None))
    cluster.fabric.inject(FaultRule(FaultAction.DROP, lambda _: rng.random() < scenario.drop,
                                    remaining=None))
    cluster.fabric.inject(FaultRule(FaultAction.DELAY, lambda _: rng.random() < 0.3,
                                    delay_s=scenario.delay, remaining=None))
    requests = [cluster.new_request(tokens) for tokens, _ in scenario.requests]
    started = cluster.clock()
    for request, (_, parts) in zip(requests, scenario.requests, strict=True):
        _start(cluster, request, parts)
    rooms = [r.room for r in requests]
    schedule = collections.defaultdict(list)
    for at, kind, seed in scenario.hostile:
        schedule[at].append((kind, seed))
    ended: dict[tuple[str, str], float] = {}
    for round_ in range(1000):
        for kind, seed in schedule.get(round_, []):
            _inject(cluster, scenario, (kind, seed), rooms, captured)
        cluster.step()
        for request in requests:
            for endpoint in cluster.endpoints:
                status = endpoint.poll(request.room)
                if status is not None and status.finished:
                    ended.setdefault((request.room, endpoint.role.value), cluster.clock())
        if len(ended) == 2 * len(requests) and round_ > max(schedule, default=0):
            break
        cluster.clock.advance(TICK_S)
    timeouts = cluster.timeouts
    bounds = {"decode": timeouts.bootstrap_s + timeouts.transfer_s,
              "prefill": timeouts.kv_lease_s + timeouts.transfer_s}
    assert len(ended) == 2 * len(requests), "a request never ended"
    for (room, role), at in ended.items():
        assert at - started <= bounds[role] + TICK_S, f"{role} {room} ended at {at}"
    for request in requests:
        for endpoint in cluster.endpoints:
            status = endpoint.poll(request.room)
            assert status is not None
            TALLY[f"{endpoint.role.value}:{status.state.value}"
                  f"{':' + status.reason.value if status.reason else ''}"] += 1
        decoded = receiver.poll(request.room)
        assert decoded is not None
        if decoded.state is State.SUCCEEDED:
            assert cluster.verified(request), f"{request.room} Succeeded with wrong KV"
    for _ in range(20):  # let quarantine and buffered early requests expire
        cluster.clock.advance(0.5)
        cluster.step()
    assert cluster.counts() == baseline
    ring = receiver.ring_buffer.clone()
    for region in granted:
        ring[region.offset_bytes : region.offset_bytes + region.size_bytes] = GUARD
    assert bool((ring == GUARD).all()), "a byte outside every granted region changed"
    slots = torch.ones(receiver.pool.layout.num_pages * receiver.pool.layout.page_size,
                       dtype=torch.bool)
    for page in (p for r in requests for p in r.dst_pages):
        size = receiver.pool.layout.page_size
        slots[page * size : (page + 1) * size] = False
    for tensor, before in zip(receiver.pool.tensors(), pool_guard, strict=True):
        after = tensor.view(torch.uint8)
        assert torch.equal(after[:, slots], before[:, slots]), "a page outside the requests"
