"""The part-state table of the grant/write protocol: every legal transition, every illegal
one refused with the state unchanged and counted, and the count reaching the endpoint's
metrics (docs/failure-modes.md #1, #8)."""

from __future__ import annotations

import itertools

import pytest
from prometheus_client import CollectorRegistry

from pd_testbed.transfer_harness import Cluster
from pd_transfer.common.metrics import TransferMetrics
from pd_transfer.errors import LocalProtocolError
from pd_transfer.kv.ring import Region
from pd_transfer.protocol.lifecycle import Role, State
from pd_transfer.protocol.parts import (
    INITIAL,
    PART_TRANSITIONS,
    TERMINAL_PARTS,
    Part,
    PartEvent,
    PartMachine,
    PartState,
    Quarantined,
)

pytestmark = pytest.mark.timeout(30)

# Written from the protocol (PROTOCOL.md "Part states"), not from the code's table.
EXPECTED = {
    ("WaitingReady", "ready"): "WaitingStaging",
    ("WaitingReady", "post"): "Writing",
    ("WaitingStaging", "gather"): "AwaitingGrant",
    ("AwaitingGrant", "post"): "Writing",
    ("Writing", "done"): "Written",
    ("Unseen", "queue"): "Queued",
    ("Unseen", "grant"): "Granted",
    ("Unseen", "refuse"): "Refused",
    ("Unseen", "notify"): "Arrived",
    ("Queued", "grant"): "Granted",
    ("Queued", "refuse"): "Refused",
    ("Granted", "land"): "Scattering",
    ("Granted", "withdraw"): "Unseen",
    ("Scattering", "scattered"): "Arrived",
}

# How a part of each side reaches each state (side, events from the side's first state).
PATHS = {
    "WaitingReady": (Role.PREFILL, []),
    "WaitingStaging": (Role.PREFILL, ["ready"]),
    "AwaitingGrant": (Role.PREFILL, ["ready", "gather"]),
    "Writing": (Role.PREFILL, ["post"]),
    "Written": (Role.PREFILL, ["post", "done"]),
    "Unseen": (Role.DECODE, []),
    "Queued": (Role.DECODE, ["queue"]),
    "Granted": (Role.DECODE, ["queue", "grant"]),
    "Refused": (Role.DECODE, ["refuse"]),
    "Scattering": (Role.DECODE, ["grant", "land"]),
    "Arrived": (Role.DECODE, ["grant", "land", "scattered"]),
}


def _at(state: PartState, machine: PartMachine) -> Part:
    side, events = PATHS[state.value]
    part = Part(index=3, side=side)
    for event in events:
        machine.apply(part, PartEvent(event))
    assert part.state is state
    return part


def test_the_table_is_exactly_the_documented_one() -> None:
    assert {(s.value, e.value): t.value for (s, e), t in PART_TRANSITIONS.items()} == EXPECTED
    assert {s.value for s in TERMINAL_PARTS} == {"Written", "Refused", "Arrived"}
    assert {side: state.value for side, state in INITIAL.items()} == {
        Role.PREFILL: "WaitingReady", Role.DECODE: "Unseen"}
    assert set(PATHS) == {s.value for s in PartState}


@pytest.mark.parametrize(("state", "event"), list(itertools.product(PartState, PartEvent)),
                         ids=lambda v: v.value)
def test_every_state_event_pair_is_either_legal_or_refused_unchanged_and_counted(
    state: PartState, event: PartEvent
) -> None:
    seen: list[tuple[PartState, PartEvent]] = []
    machine = PartMachine(lambda s, e: seen.append((s, e)))
    part = _at(state, machine)
    target = EXPECTED.get((state.value, event.value))
    if target is not None:
        assert machine.apply(part, event).value == target
        assert part.state.value == target
        assert not machine.refused and not seen
        return
    with pytest.raises(LocalProtocolError, match=f"can't handle event '{event.value}'"):
        machine.apply(part, event)
    assert part.state is state
    assert machine.refused == {(state, event): 1}
    assert seen == [(state, event)]


def test_terminal_parts_take_no_event() -> None:
    machine = PartMachine()
    for state in TERMINAL_PARTS:
        part = _at(state, machine)
        for event in PartEvent:
            with pytest.raises(LocalProtocolError):
                machine.apply(part, event)
            assert part.state is state
    assert sum(machine.refused.values()) == len(TERMINAL_PARTS) * len(PartEvent)


def test_refusals_reach_the_metrics_snapshot_and_prometheus() -> None:
    metrics = TransferMetrics(Role.DECODE, CollectorRegistry())
    machine = PartMachine(metrics.part_transition_refused)
    part = _at(PartState.ARRIVED, machine)
    for _ in range(2):
        with pytest.raises(LocalProtocolError):
            machine.apply(part, PartEvent.GRANT)
    assert metrics.snapshot().refused_transitions == {"Arrived:grant": 2}
    assert metrics.registry.get_sample_value(
        "pd_transfer_refused_part_transitions_total", {"state": "Arrived", "event": "grant"}
    ) == 2


def test_an_endpoint_counts_refusals_and_a_clean_transfer_has_none() -> None:
    cluster = Cluster(mode="staged")
    request = cluster.new_request(num_tokens=16)
    cluster.start(request)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == {State.SUCCEEDED} and cluster.verified(request)
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    assert receiver.metrics.snapshot().refused_transitions == {}
    assert sender.metrics.snapshot().refused_transitions == {}
    written = _at(PartState.WRITTEN, PartMachine())
    with pytest.raises(LocalProtocolError):
        sender.part_machine.apply(written, PartEvent.POST)
    assert sender.metrics.snapshot().refused_transitions == {"Written:post": 1}
    assert sender.part_machine.refused == {(PartState.WRITTEN, PartEvent.POST): 1}


def test_a_quarantined_region_matches_only_its_own_late_write() -> None:
    entry = Quarantined(Region(7, "room", 512, 300, 512), "prefill-0", 10.0, 2, 41)
    assert entry.matches("prefill-0", 41, 512, 300, 2)
    assert not entry.matches("prefill-1", 41, 512, 300, 2)
    assert not entry.matches("prefill-0", 40, 512, 300, 2)  # another request incarnation
    assert not entry.matches("prefill-0", 41, 0, 300, 2)
    assert not entry.matches("prefill-0", 41, 512, 256, 2)
    assert not entry.matches("prefill-0", 41, 512, 300, 1)
