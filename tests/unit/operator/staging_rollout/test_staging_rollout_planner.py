"""The staging rollout planner, as data: a small simulated fleet, a fixed clock, exact step
sequences, and two invariants checked after every step of every scenario:
- never more than maxUnavailable pods resizing (what the pod's role allocates, the decode ring
  or the prefill buffer, differs between spec and report, or `resizing`);
- no prefill chunk limit above the smallest decode ring (a pod in transition counts at its
  worse size: rings at the smaller, limits at the larger).
No cluster, no NIXL and no GPU needed."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import pytest

from pd_contract.transferagent import AgentStaging, Role
from pd_operator.api.status import (
    RollbackReason,
    RolloutMode,
    RolloutPhase,
    StagingRolloutStatus,
)
from pd_operator.api.transfer_spec import StagingRollout, TransferHealthPolicy
from pd_operator.staging_rollout.planner import (
    PodHealth,
    StagingDecision,
    StagingPod,
    StagingReason,
    compute_minimum_staging,
    observe_pod,
    plan_rollout,
)
from pd_operator.status import PodObservation, ReportState, observe_fleet
from pd_testbed.factories import make_spec
from pd_testbed.kube_factories import make_agent, make_pod

T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


def staging(decode_pool_mib: int, prefill_buffer_mib: int) -> AgentStaging:
    return AgentStaging(decode_pool_mib=decode_pool_mib, prefill_buffer_mib=prefill_buffer_mib)


TICK = timedelta(seconds=30)
STALE_S = 60.0
OLD = staging(4096, 2048)
BIG = staging(6144, 2048)
SMALL = staging(2048, 2048)
# Grows what both roles allocate (decode ring and prefill buffer): prefill pods are batched too.
BOTH = staging(6144, 3072)
FLEET = ("prefill-0", "prefill-1", "decode-0", "decode-1")


def policy(max_unavailable: int = 1, *, auto_rollback: bool = True,
           analysis_seconds: int = 60) -> StagingRollout:
    return StagingRollout(max_unavailable=max_unavailable, analysis_seconds=analysis_seconds,
                          max_failure_ratio=0.01, auto_rollback=auto_rollback)


def role_of(name: str) -> Role:
    return Role.PREFILL if name.startswith("prefill") else Role.DECODE


@dataclass
class SimPod:
    """One pod and its agent: applies its spec one tick after it is written."""

    name: str
    spec: AgentStaging | None
    reported: AgentStaging | None
    report_time: datetime | None = T0
    transfers: int = 100
    failures: int = 0
    written_at: datetime | None = None
    applied_at: datetime | None = T0 - timedelta(hours=1)
    silent: bool = False      # stops reporting (report_time frozen)
    stuck: bool = False       # never applies a new spec


@dataclass
class Fleet:
    """The cluster as the executor and the agents would leave it between two reconciles."""

    pods: dict[str, SimPod]
    now: datetime = T0
    status: StagingRolloutStatus = field(default_factory=StagingRolloutStatus)
    last_good: AgentStaging | None = None
    trace: list[tuple[str, str]] = field(default_factory=list)
    batches: list[tuple[str, ...]] = field(default_factory=list)

    @classmethod
    def at(cls, size: AgentStaging, names: tuple[str, ...] = FLEET) -> Fleet:
        fleet = cls({n: SimPod(n, size, size) for n in names})
        fleet.status = StagingRolloutStatus(
            phase=RolloutPhase.IDLE, to_decode_pool_mib=size.decode_pool_mib,
            to_prefill_buffer_mib=size.prefill_buffer_mib, total_pods=len(names),
            summary=f"{size.decode_pool_mib}MiB")
        return fleet

    def observe(self) -> list[StagingPod]:
        return [
            StagingPod(
                name=p.name, role=role_of(p.name), uid=f"uid-{p.name}", spec=p.spec,
                reported=p.reported, resizing=False,
                health=PodHealth(transfers=p.transfers, failures=p.failures,
                                 healthy=p.failures <= 0.01 * p.transfers,
                                 report_time=p.report_time),
                written_at=p.written_at, applied_at=p.applied_at)
            for p in self.pods.values()
        ]

    def decide(self, desired: AgentStaging, pol: StagingRollout) -> StagingDecision:
        return plan_rollout(desired, self.last_good, self.observe(), policy=pol,
                            previous=self.status, now=self.now, stale_after_s=STALE_S)

    def step(self, desired: AgentStaging, pol: StagingRollout) -> StagingDecision:
        """One reconcile: decide, write the status, then the specs (the executor's order)."""
        decision = self.decide(desired, pol)
        self.status = decision.status
        for write in decision.writes:
            pod = self.pods[write.pod]
            pod.spec, pod.written_at = write.size, self.now
        for name in decision.applied_now:
            self.pods[name].applied_at = self.now
        if decision.status.phase in (RolloutPhase.COMPLETE, RolloutPhase.IDLE):
            self.last_good = desired
        moved = tuple(w.pod for w in decision.writes)
        if moved:
            self.batches.append(moved)
        self.trace.append((decision.status.phase.value, decision.status.summary))
        assert_invariants(self.observe(), pol.max_unavailable)
        return decision

    def tick(self) -> None:
        """Time passes; agents apply their spec and report (the apply is not yet stamped)."""
        self.now += TICK
        for pod in self.pods.values():
            if pod.silent:
                continue
            if pod.spec is None or pod.spec == pod.reported:
                pass
            elif pod.reported is not None and allocates(role_of(pod.name), pod.spec) == \
                    allocates(role_of(pod.name), pod.reported):
                # Like the real agent: a spec that leaves the size this role allocates as
                # it is gets confirmed at once, even by a pod whose resizes never finish.
                pod.reported = pod.spec
            elif not pod.stuck:
                pod.reported, pod.applied_at = pod.spec, None
            pod.report_time = self.now

    def run(self, desired: AgentStaging, pol: StagingRollout, *, until: set[RolloutPhase],
            max_steps: int = 60) -> StagingDecision:
        for _ in range(max_steps):
            decision = self.step(desired, pol)
            if decision.status.phase in until:
                return decision
            self.tick()
        raise AssertionError(f"no {until} after {max_steps} steps: {self.trace[-3:]}")


def allocates(role: Role, size: AgentStaging) -> int:
    """The MiB of `size` a pod of `role` allocates (its ring, or its buffer)."""
    return size.decode_pool_mib if role is Role.DECODE else size.prefill_buffer_mib


def assert_invariants(pods: list[StagingPod], max_unavailable: int) -> None:
    resizing = [p.name for p in pods if p.reported is not None and (
        p.spec is None or p.resizing
        or allocates(p.role, p.spec) != allocates(p.role, p.reported))]
    assert len(resizing) <= max_unavailable, resizing
    rings = [min(s.decode_pool_mib for s in (p.spec, p.reported) if s)
             for p in pods if p.role is Role.DECODE and (p.spec or p.reported)]
    limits = [max(s.decode_pool_mib for s in (p.spec, p.reported) if s)
              for p in pods if p.role is Role.PREFILL and (p.spec or p.reported)]
    if rings and limits:
        assert max(limits) <= min(rings), (limits, rings)


def dedup(trace: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [t for i, t in enumerate(trace) if i == 0 or trace[i - 1] != t]


@pytest.mark.parametrize(
    ("target", "max_unavailable", "batches", "summaries"),
    [
        # Grow: decode rings first (decode-0, decode-1), one batch each; the prefill pods
        # allocate nothing more (their buffer stays 2048), so their specs follow in one write
        # once every ring is large enough, and count only once they confirm it (2/4 → done).
        (BIG, 1, [("decode-0",), ("decode-1",), ("prefill-0", "prefill-1")],
         ["4096→6144MiB 0/4", "4096→6144MiB 1/4", "4096→6144MiB 2/4", "6144MiB"]),
        (BIG, 2, [("decode-0", "decode-1"), ("prefill-0", "prefill-1")],
         ["4096→6144MiB 0/4", "4096→6144MiB 2/4", "6144MiB"]),
        # Both sizes grow: every pod changes, one batch per pod, decode rings first.
        (BOTH, 1, [("decode-0",), ("decode-1",), ("prefill-0",), ("prefill-1",)],
         ["4096→6144MiB 0/4", "4096→6144MiB 1/4", "4096→6144MiB 2/4", "4096→6144MiB 3/4",
          "4096→6144MiB 4/4", "6144MiB"]),
        # Shrink: prefill limits first (one write, nothing to resize; confirmed by the next
        # reports), then decode rings.
        (SMALL, 1, [("prefill-0", "prefill-1"), ("decode-0",), ("decode-1",)],
         ["4096→2048MiB 0/4", "4096→2048MiB 2/4", "4096→2048MiB 3/4", "4096→2048MiB 4/4",
          "2048MiB"]),
        (SMALL, 2, [("prefill-0", "prefill-1"), ("decode-0", "decode-1")],
         ["4096→2048MiB 0/4", "4096→2048MiB 2/4", "4096→2048MiB 4/4", "2048MiB"]),
    ],
    ids=["grow-mu1", "grow-mu2", "grow-both-mu1", "shrink-mu1", "shrink-mu2"],
)
def test_rollout_moves_rings_and_limits_in_safe_batches(
    target: AgentStaging, max_unavailable: int, batches: list[tuple[str, ...]],
    summaries: list[str],
) -> None:
    """Exact batches and printer-column sequence; invariants after every step.
    Guards against: a prefill writer sending chunks sized for a ring its decode peer has not
    grown yet (or no longer has after a shrink), and batches larger than maxUnavailable."""
    fleet = Fleet.at(OLD)
    final = fleet.run(target, policy(max_unavailable), until={RolloutPhase.COMPLETE})
    assert fleet.batches == batches
    assert [summary for _, summary in dedup(fleet.trace)] == summaries
    assert final.status.updated_pods == sorted(FLEET)
    assert final.events[-1].reason is StagingReason.COMPLETE
    assert all(p.spec == target and p.reported == target for p in fleet.pods.values())


def test_each_batch_waits_for_apply_and_analysis_before_the_next() -> None:
    """The step-by-step sequence of one batch: write, then (one tick later) in force and first
    seen, then analysed for 60 s, then the next write. Guards against starting the next batch
    on the first report of the new size, before any health was observed under it."""
    fleet = Fleet.at(OLD)
    messages = []
    for _ in range(5):
        messages.append(fleet.step(BIG, policy()).status.message)
        fleet.tick()
    size = "decodePoolMiB=6144/prefillBufferMiB=2048"
    assert messages == [
        f"Resizing decode-0 to {size}",                                 # t=0: write
        "Batch decode-0: analysing transfer health for 60s",           # t=30: applied, stamped
        "Batch decode-0: analysing transfer health for 60s",           # t=60: 30 s analysed
        f"Resizing decode-1 to {size}",                                 # t=90: 60 s → next
        "Batch decode-1: analysing transfer health for 60s",
    ]


@pytest.mark.parametrize("max_unavailable", [1, 2])
def test_failed_analysis_pauses_then_rolls_back_in_batches(max_unavailable: int) -> None:
    """The first resized pod fails analysis → Paused (rolling back) → RolledBack, every pod at
    the old size, last good unchanged, message naming pod and reason. Guards against a rollout
    that keeps going (or rolls back all pods at once) while transfers fail."""
    fleet = Fleet.at(OLD)
    fleet.step(BIG, policy(max_unavailable))
    fleet.tick()
    for name in fleet.batches[0]:
        fleet.pods[name].failures = 5          # 5/100 > maxFailureRatio 0.01
    final = fleet.run(BIG, policy(max_unavailable), until={RolloutPhase.ROLLED_BACK})
    phases = [phase for phase, _ in dedup(fleet.trace)]
    assert phases[0] == "Progressing"
    assert phases[-1] == "RolledBack"
    assert set(phases[1:-1]) == {"Paused"}
    assert final.status.message == (
        "decode-0: transfer failure ratio 0.050 (5/100) is above maxFailureRatio 0.01; "
        "rolled back to decodePoolMiB=4096/prefillBufferMiB=2048")
    assert all(p.spec == OLD and p.reported == OLD for p in fleet.pods.values())
    assert fleet.last_good is None            # never marked good: OLD stays the last good
    assert final.status.summary == "4096MiB RolledBack"
    # RolledBack is sticky while the spec still asks for the failed size.
    fleet.tick()
    again = fleet.step(BIG, policy(max_unavailable))
    assert (again.status.phase, again.writes, again.events) == (RolloutPhase.ROLLED_BACK, (), ())


def test_rollback_of_a_late_failure_restores_rings_last() -> None:
    """A failure after both decode rings grew and prefill-0 took the larger limit: prefill
    limits go back first, decode rings after, one pod at a time. Guards against shrinking a
    ring under a prefill writer that still sends large chunks during rollback."""
    fleet = Fleet.at(OLD)
    pol = policy(1)
    while fleet.batches[-1:] != [("prefill-0",)]:
        fleet.step(BOTH, pol)
        fleet.tick()
    fleet.pods["prefill-0"].failures = 50
    fleet.run(BOTH, pol, until={RolloutPhase.ROLLED_BACK})
    assert fleet.batches == [("decode-0",), ("decode-1",), ("prefill-0",),
                             ("prefill-0",), ("decode-0",), ("decode-1",)]


def test_failure_without_auto_rollback_holds_every_pod_where_it_is() -> None:
    """autoRollback off: Paused, no writes, the message says how to resume, and it stays so.
    Guards against a paused rollout that silently resumes on the next reconcile."""
    pol = policy(1, auto_rollback=False)
    fleet = Fleet.at(OLD)
    fleet.step(BIG, pol)
    fleet.tick()
    fleet.pods["decode-0"].failures = 3
    paused = fleet.step(BIG, pol)
    assert paused.status.phase is RolloutPhase.PAUSED
    assert paused.status.message.startswith("decode-0: transfer failure ratio 0.030 (3/100)")
    assert "set decodePoolMiB back to decodePoolMiB=4096" in paused.status.message
    assert [e.reason for e in paused.events] == [StagingReason.PAUSED]
    fleet.pods["decode-0"].failures = 0
    for _ in range(4):
        fleet.tick()
        held = fleet.step(BIG, pol)
        assert (held.status.phase, held.writes, held.events) == (RolloutPhase.PAUSED, (), ())
    assert held.status.message == paused.status.message


def test_restarted_operator_makes_the_same_next_decision() -> None:
    """A fresh planner on the same observed pods and stored status decides the same step; and
    when the crash lost the status write after the spec writes, the next decision writes
    nothing more. Guards against a step index kept in memory (a restart repeating or
    skipping a batch, or doubling the pods resizing)."""
    pol = policy(2)
    fleet = Fleet.at(OLD, ("prefill-0", "prefill-1", "prefill-2", "decode-0", "decode-1",
                           "decode-2"))
    for _ in range(4):
        fleet.step(BOTH, pol)
        fleet.tick()
    assert fleet.decide(BOTH, pol) == fleet.decide(BOTH, pol)
    # Run to the next write, then replay it as if the status write had been lost.
    before = fleet.status
    while not (decision := fleet.step(BOTH, pol)).writes:
        before = fleet.status
        fleet.tick()
    fleet.status = before
    replay = fleet.decide(BOTH, pol)
    assert replay.writes == ()
    assert replay.status.phase is RolloutPhase.PROGRESSING
    assert replay.status.updated_pods == decision.status.updated_pods
    assert replay.status.started_at == decision.status.started_at == T0


def test_new_pods_get_the_size_of_their_revision() -> None:
    """Mid-grow (decode rings done, prefill-0 updated): a restarted prefill-0 (same name, no
    TransferAgent spec) gets 6144 back; a new prefill-2 gets the last good 4096 and is rolled
    in a later batch; a new decode-2 gets 6144, because every prefill limit must fit it.
    Guards against a scaled-up decode pod joining with a ring smaller than the chunks prefill
    already sends, and against an updated pod losing its size on restart."""
    pol = policy(1)
    fleet = Fleet.at(OLD)
    while fleet.status.updated_pods != ["decode-0", "decode-1", "prefill-0"]:
        fleet.step(BOTH, pol)
        fleet.tick()
    fleet.pods["prefill-0"] = SimPod("prefill-0", None, None, report_time=None)
    fleet.pods["prefill-2"] = SimPod("prefill-2", None, None, report_time=None)
    fleet.pods["decode-2"] = SimPod("decode-2", None, None, report_time=None)
    decision = fleet.step(BOTH, pol)
    initial = {w.pod: w.size for w in decision.writes if w.pod in
               ("prefill-0", "prefill-2", "decode-2")}
    assert initial == {"prefill-0": BOTH, "prefill-2": OLD, "decode-2": BOTH}
    fleet.tick()
    fleet.run(BOTH, pol, until={RolloutPhase.COMPLETE})
    assert all(p.reported == BOTH for p in fleet.pods.values())
    assert ("prefill-2",) in fleet.batches


@pytest.mark.parametrize("silent", ["decode-0", "decode-1"])
def test_stale_report_fails_analysis(silent: str) -> None:
    """A pod of the current batch whose report is older than staleAfterSeconds fails analysis,
    though its last numbers looked fine. Guards against a dead agent (no report, so no
    failures) passing analysis."""
    pol = policy(2)
    fleet = Fleet.at(OLD)
    fleet.step(BIG, pol)
    fleet.tick()
    fleet.pods[silent].silent = True
    for _ in range(3):
        fleet.tick()
        decision = fleet.step(BIG, pol)
        if decision.status.phase is not RolloutPhase.PROGRESSING:
            break
    assert decision.status.phase is RolloutPhase.PAUSED
    assert decision.status.message.startswith(
        f"{silent}: transfer report is 90s old (stale after 60s); rolling back to")
    assert decision.events[0].reason is StagingReason.ROLLING_BACK


def test_size_not_applied_within_deadline_fails() -> None:
    """A pod that never puts the written size in force fails after 2 × analysis + 120 s.
    Guards against a rollout that waits forever on an agent that ignores its spec."""
    pol = policy(1, auto_rollback=False)
    fleet = Fleet.at(OLD)
    fleet.pods["decode-0"].stuck = True
    decision = fleet.step(BIG, pol)
    steps = 0
    while decision.status.phase is RolloutPhase.PROGRESSING:
        fleet.tick()
        decision = fleet.step(BIG, pol)
        steps += 1
    assert steps * TICK.total_seconds() == 270       # first tick past 2 × 60 + 120 = 240 s
    assert decision.status.message.startswith(
        "decode-0: decodePoolMiB=6144/prefillBufferMiB=2048 not in force 240s after it was "
        "written")


def test_size_below_one_chunk_is_refused_with_the_minimum() -> None:
    """A decode pool that cannot hold one prefill chunk never starts rolling out, and the
    message names the minimum. Guards against a relaxed policy letting every writer stall.
    Minimum (prefill TP4 → decode TP2): 8192 tokens × 4 heads × 128 × 2 bytes × 2 (K, V) × 80
    layers = 1280 MiB on a decode ring; 8192 × 2 heads (8 / TP4) × 128 × 2 × 2 × 80 = 640 MiB
    in a prefill buffer."""
    minimum = compute_minimum_staging(make_spec(prefill={"parallelism": {"tensor": 4}},
                                                decode={"parallelism": {"tensor": 2}}))
    assert minimum == staging(1280, 640)
    fleet = Fleet.at(OLD)
    too_small = staging(1024, 2048)
    decision = plan_rollout(too_small, None, fleet.observe(), policy=policy(),
                            previous=fleet.status, now=T0, stale_after_s=STALE_S,
                            minimum=minimum)
    assert decision.writes == ()
    assert decision.status.phase is RolloutPhase.PAUSED
    assert decision.status.message == (
        "Refusing decodePoolMiB=1024/prefillBufferMiB=2048: one prefill chunk needs at least "
        "decodePoolMiB=1280 and prefillBufferMiB=640; pods keep their sizes")
    assert [e.reason for e in decision.events] == [StagingReason.REFUSED]
    again = plan_rollout(too_small, None, fleet.observe(), policy=policy(),
                         previous=decision.status, now=T0, stale_after_s=STALE_S,
                         minimum=minimum)
    assert (again.status, again.events) == (decision.status, ())
    # A valid size afterwards starts from the last good size.
    fixed = plan_rollout(staging(1280, 2048), None, fleet.observe(), policy=policy(),
                         previous=again.status, now=T0, stale_after_s=STALE_S,
                         minimum=minimum)
    assert fixed.status.phase is RolloutPhase.PROGRESSING
    assert fixed.status.from_decode_pool_mib == 4096


def test_a_recorded_size_below_one_mib_counts_as_no_record() -> None:
    """The status allows 0 in its from/to fields, a staging size does not (1 MiB at least):
    a hand-edited `toDecodePoolMiB: 0` records no size, and the last good size then comes
    from what the pods' specs ask for. Guards against a rollout from a 0 MiB ring (a spec
    write the API server refuses on every reconcile) or a planner that raises on it."""
    fleet = Fleet.at(OLD)
    edited = fleet.status.model_copy(update={"to_decode_pool_mib": 0})
    decision = plan_rollout(BIG, None, fleet.observe(), policy=policy(), previous=edited,
                            now=T0, stale_after_s=STALE_S)
    assert decision.status.phase is RolloutPhase.PROGRESSING
    assert (decision.status.from_decode_pool_mib, decision.status.to_decode_pool_mib) == (
        4096, 6144)
    assert decision.status.summary == "4096→6144MiB 0/4"
    assert [w.pod for w in decision.writes] == ["decode-0"]


def test_steady_fleet_is_idle_and_writes_nothing() -> None:
    """Every pod at the desired size: Idle, `4096MiB`, no writes, no events. Guards against a
    reconcile that rewrites TransferAgents or emits events in a steady state."""
    fleet = Fleet.at(OLD)
    decision = fleet.decide(OLD, policy())
    assert decision == StagingDecision(
        status=StagingRolloutStatus(
            phase=RolloutPhase.IDLE, to_decode_pool_mib=4096, to_prefill_buffer_mib=2048,
            total_pods=4, summary="4096MiB"))


def test_first_pods_get_the_desired_size_without_a_rollout() -> None:
    """A new deployment (no status, no TransferAgent specs yet): every pod gets the desired
    size at once and the phase is Idle. Guards against a creation that looks like a rollout
    (one pod at a time, with events)."""
    fleet = Fleet({n: SimPod(n, None, None, report_time=None) for n in FLEET})
    decision = fleet.decide(OLD, policy())
    assert {(w.pod, w.size) for w in decision.writes} == {(n, OLD) for n in FLEET}
    assert (decision.status.phase, decision.events) == (RolloutPhase.IDLE, ())


def test_report_of_a_previous_incarnation_is_ignored() -> None:
    """`observe_pod` takes its report from the fleet observation, whose one incarnation rule
    drops a report whose podUID is not the pod's: a StatefulSet pod recreated under the same
    name must not inherit its predecessor's size or health, in the rollout as in the status."""
    agent = make_agent("decode-0", role="decode", pod_uid="old", report_time=T0,
                       window=(10, 0), staging_mib=(BIG.decode_pool_mib,
                                                    BIG.prefill_buffer_mib))
    agent["spec"]["staging"] = BIG.to_wire()

    def pod(uid: str) -> PodObservation:
        (observed,) = observe_fleet([make_pod("decode-0", role="decode", uid=uid)], [agent], T0,
                                    health=TransferHealthPolicy()).pods
        return observed

    mine = observe_pod(pod("old"))
    theirs = observe_pod(pod("new"))
    assert mine.reported == BIG and mine.health.transfers == 10
    assert theirs == replace(mine, uid="new", reported=None, health=PodHealth())
    assert (pod("old").verdict.state, pod("new").verdict.state) == (
        ReportState.HEALTHY, ReportState.MISSING)


@pytest.mark.parametrize("seed", range(0, 300, 30))
def test_random_histories_keep_both_invariants_and_settle(seed: int) -> None:
    """Seeded random histories: the spec changes mid-rollout, pods restart or fail, policies
    vary; after every step at most maxUnavailable pods resize and the ring rule holds (checked
    in `Fleet.step`), and a healthy fleet then settles. Guards against mixed states (three
    sizes in play) that the grow/shrink orders alone do not cover."""
    sizes = [OLD, BIG, SMALL, staging(8192, 2048), staging(4096, 1024)]
    for offset in range(30):
        rng = random.Random(seed + offset)
        names = (tuple(f"prefill-{i}" for i in range(rng.randint(1, 3)))
                 + tuple(f"decode-{i}" for i in range(rng.randint(1, 3))))
        fleet = Fleet.at(OLD, names)
        desired = rng.choice(sizes)
        pol = policy(rng.randint(1, 3), auto_rollback=rng.random() < 0.7,
                     analysis_seconds=rng.choice([0, 30, 60]))
        for _ in range(40):
            if rng.random() < 0.1:
                desired = rng.choice(sizes)
            if rng.random() < 0.05:
                name = rng.choice(list(fleet.pods))
                fleet.pods[name] = SimPod(name, None, None, report_time=None)
            if rng.random() < 0.05:
                fleet.pods[rng.choice(list(fleet.pods))].failures = rng.choice([0, 5])
            fleet.step(desired, pol)
            fleet.tick()
        for pod in fleet.pods.values():
            pod.failures = 0
        fleet.run(desired, pol, until={RolloutPhase.COMPLETE, RolloutPhase.IDLE,
                                       RolloutPhase.ROLLED_BACK, RolloutPhase.PAUSED},
                  max_steps=80)


def test_a_stopped_rollout_is_read_back_from_its_fields_never_its_message() -> None:
    """Mode and rollback reason come back from their own status fields: a message edited by
    anyone changes neither the next step nor the reason it names; a held rollout rolls back
    once autoRollback is turned on. Guards against state recovered by parsing a sentence."""
    fleet = Fleet.at(OLD)
    held_policy = policy(1, auto_rollback=False)
    fleet.step(BIG, held_policy)
    fleet.tick()
    fleet.pods["decode-0"].failures = 5
    held = fleet.step(BIG, held_policy)
    reason = "decode-0: transfer failure ratio 0.050 (5/100) is above maxFailureRatio 0.01"
    assert (held.status.phase, held.status.mode) == (RolloutPhase.PAUSED, RolloutMode.HOLD)
    assert held.status.rollback_reason is RollbackReason.FAILURE_RATIO
    assert held.status.rollback_message == reason
    fleet.status = held.status.model_copy(update={"message": "someone wrote here"})
    fleet.tick()
    again = fleet.step(BIG, held_policy)
    assert (again.writes, again.status.message) == ((), held.status.message)
    fleet.status = again.status.model_copy(update={"message": ""})
    final = fleet.run(BIG, policy(1), until={RolloutPhase.ROLLED_BACK})
    assert final.status.mode is RolloutMode.ROLLBACK
    assert final.status.message == f"{reason}; rolled back to {OLD}"
    assert all(p.spec == OLD for p in fleet.pods.values())


def test_decode_pool_only_rollout_skips_prefill_pods() -> None:
    """A decodePoolMiB-only rollout (docs/failure-modes.md #25) walks only
    the decode pods through write → in force → analysisSeconds; the prefill pods, whose buffer
    does not change, get their spec in one write that is neither a batch (no
    StagingBatchResizing event) nor analysed, and the rollout completes on the next reconcile.
    Guards against the demo's 4-pod rollout taking twice as long as its 2 decode pods need.
    Exact steps, 30 s apart (write, apply, 2 × 30 s analysis per decode batch):"""
    fleet = Fleet.at(OLD)
    steps = []
    for _ in range(8):
        d = fleet.step(BIG, policy())
        steps.append((d.status.phase.value, d.status.message, [e.reason.value for e in d.events],
                      tuple(w.pod for w in d.writes)))
        fleet.tick()
    size = "decodePoolMiB=6144/prefillBufferMiB=2048"
    analysing = "Batch {}: analysing transfer health for 60s"
    assert steps == [
        ("Progressing", f"Resizing decode-0 to {size}",
         ["StagingRolloutStarted", "StagingBatchResizing"], ("decode-0",)),      # t=0
        ("Progressing", analysing.format("decode-0"), [], ()),                   # t=30
        ("Progressing", analysing.format("decode-0"), [], ()),                   # t=60
        ("Progressing", f"Resizing decode-1 to {size}", ["StagingBatchResizing"],
         ("decode-1",)),                                                           # t=90
        ("Progressing", analysing.format("decode-1"), [], ()),                   # t=120
        ("Progressing", analysing.format("decode-1"), [], ()),                   # t=150
        ("Progressing", f"Writing {size} to prefill-0, prefill-1 (size in force unchanged)",
         [], ("prefill-0", "prefill-1")),                                         # t=180
        ("Complete", f"Rolled out {size}", ["StagingRolloutComplete"], ()),      # t=210
    ]
    # The old planner took 4 batches of 90 s (360 s) plus the final step; now 210 s.
    assert fleet.batches == [("decode-0",), ("decode-1",), ("prefill-0", "prefill-1")]


def test_prefill_buffer_only_rollout_skips_decode_pods() -> None:
    """The mirror case: a prefillBufferMiB-only rollout batches only prefill pods; decode
    pods get their spec in one unbatched write; never more than maxUnavailable (1) pods
    resizing at any step (checked by `Fleet.step`). Guards against #25's invariant being
    bought by walking unchanged pods."""
    target = staging(4096, 3072)
    fleet = Fleet.at(OLD)
    final = fleet.run(target, policy(1), until={RolloutPhase.COMPLETE})
    # The first write resizes prefill-0 and brings both decode specs along (not counted).
    assert fleet.batches == [("prefill-0", "decode-0", "decode-1"), ("prefill-1",)]
    # 0/4 at the write: the decode pods count once their reports confirm the new spec.
    assert [s for _, s in dedup(fleet.trace)] == [
        "buffer 2048→3072MiB 0/4", "buffer 2048→3072MiB 3/4", "buffer 2048→3072MiB 4/4",
        "4096MiB"]
    assert final.status.updated_pods == sorted(FLEET)
    assert final.status.message == "Rolled out decodePoolMiB=4096/prefillBufferMiB=3072"
    assert fleet.now - T0 == timedelta(seconds=180)  # 2 batches × 90 s


def test_unchanged_pods_count_only_once_their_reports_confirm_the_target() -> None:
    """Guards docs/failure-modes.md #30 for the pods a rollout skips: a pod whose size in
    force does not change is written without a batch, but it is neither updated nor lets the rollout
    complete, and in a shrink no decode ring shrinks, until its own report says the target;
    a pod that never confirms fails like one that never resizes (NOT_APPLIED at 2 × 60 +
    120 = 240 s), and is rolled back. Prefill pods here report on time but never take a
    new spec."""
    fleet = Fleet.at(OLD)
    pol = policy(1)
    first = fleet.step(SMALL, pol)
    assert [w.pod for w in first.writes] == ["prefill-0", "prefill-1"]
    assert [e.reason for e in first.events] == [StagingReason.STARTED]
    assert first.status.message == (f"Writing {SMALL} to prefill-0, prefill-1 (size in force "
                                    "unchanged)")
    waiting = f"Waiting for prefill-0, prefill-1 to confirm {SMALL} (size in force unchanged)"
    for elapsed in (30, 60, 90, 120, 150, 180, 210, 240):
        fleet.now = T0 + timedelta(seconds=elapsed)
        for pod in fleet.pods.values():
            pod.report_time = fleet.now
        decision = fleet.step(SMALL, pol)
        assert (decision.status.phase, decision.status.message, decision.writes,
                decision.status.updated_pods, decision.status.summary) == (
            RolloutPhase.PROGRESSING, waiting, (), [], "4096→2048MiB 0/4"), elapsed
    fleet.now = T0 + timedelta(seconds=270)
    failed = fleet.step(SMALL, pol)
    assert failed.status.rollback_reason is RollbackReason.NOT_APPLIED
    assert failed.status.rollback_message == (f"prefill-0: {SMALL} not in force 240s after it "
                                              "was written")
    assert [(w.pod, w.size) for w in failed.writes] == [("prefill-0", OLD), ("prefill-1", OLD)]


def test_a_late_confirmation_completes_the_grow_only_when_it_arrives() -> None:
    """Guards docs/failure-modes.md #30: after a decodePoolMiB-only grow wrote the prefill
    specs, the status says Complete only at the step after both prefill pods reported the
    target, never on their write alone (the earlier attempt declared Complete at once)."""
    fleet = Fleet.at(OLD)
    pol = policy(2)
    fleet.step(BIG, pol)
    fleet.tick()
    while not (decision := fleet.step(BIG, pol)).writes:
        fleet.tick()
    assert [w.pod for w in decision.writes] == ["prefill-0", "prefill-1"]
    assert decision.status.updated_pods == ["decode-0", "decode-1"]
    fleet.now += TICK
    fleet.pods["prefill-0"].reported = BIG  # prefill-1 has not reported the new spec yet
    decision = fleet.step(BIG, pol)
    assert decision.status.phase is RolloutPhase.PROGRESSING
    assert decision.status.updated_pods == ["decode-0", "decode-1", "prefill-0"]
    assert decision.status.message == (f"Waiting for prefill-1 to confirm {BIG} (size in "
                                       "force unchanged)")
    fleet.tick()
    done = fleet.step(BIG, pol)
    assert done.status.phase is RolloutPhase.COMPLETE
    assert done.status.updated_pods == sorted(FLEET)
