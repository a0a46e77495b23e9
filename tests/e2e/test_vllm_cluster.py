"""vLLM P/D on pd_transfer through the operator, end to end on this machine.

The local control plane, the operator (its own process), and the fake kubelet running the
pods of `examples/local-vllm.yaml` as real processes: a vLLM prefill pod and two vLLM decode
pods (vLLM's CPU backend from the cached vLLM virtualenv, PDTransferConnector moving the KV
over real NIXL), and the router (`pd-transfer router`, which finds the engines by watching
their pods). A single vLLM outside the cluster, with the same weights, gives the expected
tokens. A steady load of completions goes through the router the whole time.

In order:
1. every completion is token-identical to the single vLLM; TransferHealthy=True; every
   pod's TransferAgent reports moved bytes;
2. a staging rollout (grow, then shrink) completes under the load with no failed
   completion and no engine process restarted;
3. a decode engine killed (SIGKILL, its whole process group): the router drops it, the
   load goes on through the other decode, its report turns stale and its readiness gate
   False; the kubelet restarts it, and once it reports again the router sends it requests;
4. the decode scaled 2 → 1 and the prefill 1 → 2 → 1 through their PDRoles (`kubectl
   scale`) under the load: no failed completion, the leaving engine's preStop hook
   (`pd-transfer drain`) ends before its engine stops (the prefill's once its connector
   holds no KV, every transfer of its engine's requests succeeded by its own counters), and
   the router pod is the same throughout; then the router's own rollout (a change of its
   args) fails no completion either;
4b. (marked `long`, `make test-long`) engine rollouts (docs/failure-modes.md #42, #43)
   under the load: an engine argument vLLM refuses rolls back by itself without deleting a
   serving pod; an engine argument (the same KV-compatibility key) and a page-size change
   (a new key) each roll both roles surge first, each old pod drained by its own counters,
   new engines in the same router, no failed completion;
5. the same example with `transfer.backend: EngineNative` (vLLM's own NixlConnector, the
   router's vllm-nixl protocol, the transfer-agent sidecar reporting from vLLM's metrics)
   serves completions, both pods report healthy transfers, and a staging pool patch on it
   is refused with the rule's message (this control plane has no CEL, so the operator
   refuses it: SpecValid=False, a Warning Event, nothing rolled out; on 1.29+ the API
   server refuses it first with the same message, `tests/integration/test_crd_cel_server.py`);
5b. (marked `long`) an environment variable added to the EngineNative deployment under one
   client's completions rolls out surge first with no failed completion, each old pod
   drained of its engine's queues;
6. an EngineNative decode whose model has other KV heads than its prefill's (vLLM then
   fails every request with HTTP 500 while its /health stays 200): within one report window
   TransferHealthy=False names the pod and the reason, its readiness gate turns False, a
   Warning Event says so, the router stops sending to it, and its sidecar counts the
   requests vLLM ended with an error.
Budget: about 8 minutes on 2 cores (about 32 more with `long`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from pd_devcluster import ControlPlaneHandle
from pd_testbed.engine_rollout import drained, engine_pods, failed_transfers
from pd_testbed.polling import wait_for
from pd_testbed.vllm import HttpTarget, complete
from pd_testbed.vllm_cluster import (
    GROUP,
    MAX_TOKENS,
    NAME,
    NATIVE,
    PROMPTS,
    STALE_S,
    VERSION,
    Cluster,
    Outcome,
    condition_of,
    engine_native,
    exists,
    first_native_request,
    manifests,
    router_of,
    running_cluster,
    wait_serving,
)

pytestmark = [pytest.mark.e2e, pytest.mark.nixl, pytest.mark.timeout(900)]

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlaneHandle, kube_client: k8s.ApiClient,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(control_plane, kube_client,
                         Path(tmp_path_factory.mktemp("vllm-cluster"))) as live:
        yield live


def test_completions_match_one_vllm_and_every_pod_reports_transfers(cluster: Cluster) -> None:
    """Guards against a vLLM deployment that serves (or reports) nothing through pd_transfer:
    the router's completions are the single vLLM's, and the status shows it."""
    started = time.monotonic()
    wait_for("TransferHealthy=True", lambda: cluster.condition("TransferHealthy").get(
        "status") == "True", 120)
    wait_for("12 completions through the router", lambda: sum(cluster.window(
        started, time.monotonic()).values()) >= 12, 180)
    outcomes = cluster.window(started, time.monotonic())
    print(f"completions through the router: {dict(outcomes)}")
    assert set(outcomes) == {"identical"}, outcomes
    moved = wait_for("every TransferAgent reporting moved bytes", lambda: (
        a if len(a := [x for x in cluster.agents()
                       if (x.get("status") or {}).get("bytesTotal", 0) > 0]) == 3 else None), 60)
    assert sorted(a["metadata"]["name"] for a in moved) == sorted(
        [*cluster.instances("prefill"), *cluster.instances("decode")])
    status = cluster.pdd()["status"]
    transfer = status["transfer"]
    assert transfer["summary"] == "Healthy" and transfer["totals"]["bytes"] > 0, transfer
    # Every engine pod carries the KV-compatibility key the status shows for both roles.
    pods = cluster.core.list_namespaced_pod(
        cluster.namespace, label_selector=f"pd.serving.dev/deployment={NAME},"
                                          "pd.serving.dev/role in (prefill,decode)").items
    keys = {p.metadata.labels["pd.serving.dev/kv-compat"] for p in pods}
    assert len(pods) == 3 and keys == {status["prefill"]["kvCompat"]} == {
        status["decode"]["kvCompat"]}, (keys, status["prefill"], status["decode"])


def _rollout(cluster: Cluster) -> Obj:
    rollout: Obj = (cluster.pdd().get("status") or {}).get("stagingRollout") or {}
    return rollout


def test_staging_rollout_grow_then_shrink_under_load(cluster: Cluster) -> None:
    """Guards against a resize that fails completions or restarts vLLM."""
    pids = {pod: cluster.kubelet.process_of(cluster.namespace, pod)
            for pod in [*cluster.instances("prefill"), *cluster.instances("decode")]}
    for size in (32, 8):
        started = time.monotonic()
        cluster.objects.patch_namespaced_custom_object(
            GROUP, VERSION, cluster.namespace, "pddeployments", NAME,
            {"spec": {"transfer": {"staging": {"decodePoolMiB": size}}}})
        done = wait_for(f"rollout to {size} MiB Complete", lambda size=size: (
            r if (r := _rollout(cluster)).get("phase") == "Complete"
            and r.get("toDecodePoolMiB") == size
            else None), 180)
        ended = time.monotonic()
        outcomes = cluster.window(started, ended)
        print(f"rollout to {size} MiB: {ended - started:.1f} s, completions {dict(outcomes)}, "
              f"{done.get('message')}")
        assert set(outcomes) <= {"identical"}, outcomes
        assert sum(outcomes.values()) > 0
        pools = {a["metadata"]["name"]: (a.get("status") or {}).get("staging", {}).get(
            "decodePoolMiB") for a in cluster.agents() if a["spec"]["role"] == "decode"}
        assert pools == dict.fromkeys(cluster.instances("decode"), size)
    after = {pod: cluster.kubelet.process_of(cluster.namespace, pod) for pod in pids}
    assert {p: r.pid for p, r in after.items() if r} == {p: r.pid for p, r in pids.items() if r}
    assert all(r is not None for r in after.values())


def test_killed_decode_leaves_the_router_goes_stale_and_comes_back(cluster: Cluster) -> None:
    survivor, victim = cluster.instances("decode")
    record = cluster.kubelet.process_of(cluster.namespace, victim)
    assert record is not None
    killed = time.monotonic()
    os.killpg(record.pid, signal.SIGKILL)  # the server and its engine-core process
    # The budgets below cover a host stall (2 cores: the kernel has reported a CPU stuck
    # for 30-80 s); the figures printed are what this run took.
    wait_for("the router down to one decode engine", lambda: cluster.router_metric(
        "pd_router_endpoints", role="decode") == 1.0, 120)
    dropped = time.monotonic()
    stale = wait_for(f"{victim} listed stale", lambda: (
        t if victim in (t := (cluster.pdd().get("status") or {}).get("transfer") or {}).get(
            "stalePods", []) else None), STALE_S + 120)
    assert victim in stale["stalePods"]
    gate = wait_for(f"{victim}'s transfer gate False", lambda: (
        g if (g := cluster.podcondition_of(victim, "pd.serving.dev/transfer-ready")).get(
            "status") == "False" else None), 120)
    print(f"{victim} killed: out of the router after {dropped - killed:.1f} s, gate "
          f"{gate.get('reason')} after {time.monotonic() - killed:.1f} s")
    served = cluster.window(dropped + 1.0, time.monotonic())
    assert served["identical"] > 0 and set(served) == {"identical"}, served
    # The kubelet restarts it; the new engine reports, its gate turns True, the router
    # takes it back and sends it requests. The load pauses meanwhile: on 2 cores a vLLM
    # starting beside two loaded engines took 5 minutes.
    cluster.paused.set()
    stale_seen: set[tuple[str, str]] = set()

    def back_in_the_router() -> bool:
        transfer = (cluster.pdd().get("status") or {}).get("transfer") or {}
        stale_seen.update((e["pod"], e["peer"]) for e in transfer.get("stalePeers", []))
        return cluster.router_metric("pd_router_endpoints", role="decode") == 2.0

    try:
        wait_for("the router back to two decode engines", back_in_the_router, 300)
    finally:
        cluster.paused.clear()
    back = time.monotonic()
    assert cluster.podcondition_of(victim, "pd.serving.dev/transfer-ready")["status"] == "True"
    # Requests the restarted engine finished (its counters start at 0 with the process).
    wait_for(f"{victim} serving again", lambda: (cluster.engine_metric(
        victim, "vllm:e2e_request_latency_seconds_count") or 0) > 0, 120)
    restarted = cluster.pod(victim)["status"]["containerStatuses"][0]["restartCount"]
    print(f"{victim} back in the router {back - killed:.1f} s after the kill "
          f"(restartCount {restarted}); completions since: "
          f"{dict(cluster.window(back, time.monotonic()))}")
    assert restarted == 1
    # The prefill dropped the victim's earlier incarnation by itself (PDTransfer keys peers
    # by NIXL agent and re-checks a pod's documents when it reaches it again): it holds the
    # restarted engine's agents only, and the status names no stale peer state.
    def prefill_holds_the_new_victim_only() -> Obj | None:
        reports = {a["metadata"]["name"]: a.get("status") or {} for a in cluster.agents()}
        current = set(reports.get(victim, {}).get("agents", []))
        held = [set(p["agents"]) for name, r in reports.items() if "-prefill-" in name
                for p in r.get("peers", []) if p["pod"] == victim]
        transfer = (cluster.pdd().get("status") or {}).get("transfer") or {}
        return transfer if (current and held and all(h <= current for h in held)
                            and not transfer.get("stalePeers")) else None

    wait_for("the prefill to hold the restarted decode's agents only, no stale peers",
             prefill_holds_the_new_victim_only, 60)
    print(f"stale peer state seen while {victim} restarted: {sorted(stale_seen)}")
    assert survivor != victim
    assert json.dumps(cluster.window(back, time.monotonic())) and set(
        cluster.window(back, time.monotonic())) <= {"identical"}


def _router_pod(cluster: Cluster) -> tuple[str, int]:
    """The router pod's uid and its container's restart count."""
    pods = cluster.core.list_namespaced_pod(
        cluster.namespace, label_selector=f"pd.serving.dev/deployment={NAME},"
                                          "app.kubernetes.io/component=router").items
    assert len(pods) == 1, [p.metadata.name for p in pods]
    statuses = pods[0].status.container_statuses or []
    return pods[0].metadata.uid, sum(c.restart_count for c in statuses)


def _scale(cluster: Cluster, role: str, replicas: int) -> None:
    """`kubectl scale pdrole <name>-<role> --replicas N`: the /scale subresource."""
    cluster.objects.patch_namespaced_custom_object_scale(
        GROUP, VERSION, cluster.namespace, "pdroles", f"{NAME}-{role}",
        {"spec": {"replicas": replicas}})


def _scale_down(cluster: Cluster, role: str) -> str:
    """`kubectl scale` the role to one instance; the instance the operator chose to remove
    (its Event names it and why), once it is out of the router and its engine stopped."""
    before = cluster.instances(role)
    _scale(cluster, role, 1)
    victim: str = wait_for(f"a {role} instance chosen to leave", lambda: next(
        (p for p in before if p not in cluster.instances(role)), None), 60)
    wait_for(f"{victim} out of the router and its engine stopped", lambda: cluster.router_metric(
        "pd_router_endpoints", role=role) == 1.0 and cluster.kubelet.process_of(
        cluster.namespace, victim) is None, 180)
    messages = [e.message for e in cluster.core.list_namespaced_event(cluster.namespace).items
                if e.reason == "DeletingInstance" and e.involved_object.name == NAME]
    assert any(f"deleting instance {victim} (" in m and "the cheapest to lose" in m
               for m in messages), messages
    return victim


def _hook_lines(cluster: Cluster, pod: str, role: str) -> list[str]:
    """What the pod's preStop hook printed (the kubelet writes it into the engine's log)."""
    logs = sorted((cluster.kubelet.work_dir / cluster.namespace).glob(f"{pod}-*/engine.log"),
                  key=lambda path: path.stat().st_mtime)  # the incarnation that left last
    return [line for line in logs[-1].read_text().splitlines()
            if "drain" in line and role in line]


def test_decode_scaled_down_through_its_pdrole_fails_no_request(cluster: Cluster) -> None:
    """Guards against a scale-down that stops a decode mid-generation, and a replica change
    that restarts the router (docs/failure-modes.md #39): `kubectl scale` on the decode's
    PDRole 2 -> 1, under the load; the leaving decode's preStop hook (`pd-transfer drain`)
    ends before its engine is stopped, and the router pod stays the same."""
    router = _router_pod(cluster)
    started = time.monotonic()
    victim = _scale_down(cluster, "decode")
    down = time.monotonic()
    hook = _hook_lines(cluster, victim, "decode")
    print(f"{victim} scaled away in {down - started:.1f} s; completions "
          f"{dict(cluster.window(started, down))}; its hook: {hook}")
    assert hook[0].startswith("preStop: ") and hook[-1].startswith("drained decode after "), hook
    assert set(cluster.window(started, down)) == {"identical"}
    assert sum(cluster.window(started, down).values()) > 0
    assert _router_pod(cluster) == router
    assert cluster.pdd()["spec"]["decode"]["replicas"] == 1
    # A new decode joining the same router is shown by the prefill's scale-up below and by
    # the engine rollouts (new pods of both roles), which run on this one decode.


DRAINED = re.compile(r"drained prefill after [0-9.]+ s: the engine finished ([0-9]+) "
                     r"requests; connector transfers: ([0-9]+) succeeded, ([0-9]+) failed")


def test_prefill_scaled_up_and_down_through_its_pdrole_fails_no_request(cluster: Cluster) -> None:
    """Guards against a prefill stopped while decode still pulls its KV (docs/failure-modes.md
    #39): `kubectl scale` on the prefill's PDRole 1 -> 2 -> 1 under the load. The new
    prefill joins the same router and serves; the leaving one's preStop hook ends only once
    its connector holds no KV, and by its own counters at that moment every request its
    engine finished had its transfer succeed, none failed."""
    (first,) = cluster.instances("prefill")
    router = _router_pod(cluster)
    started = time.monotonic()
    cluster.paused.set()  # as for the decode above: a vLLM start gets the cores
    try:
        _scale(cluster, "prefill", 2)
        joined = wait_for("a second prefill instance", lambda: next(
            (p for p in cluster.instances("prefill") if p != first), None), 60)
        wait_for("the router at two prefill engines", lambda: cluster.router_metric(
            "pd_router_endpoints", role="prefill") == 2.0, 300)
    finally:
        cluster.paused.clear()
    wait_for(f"{joined} serving", lambda: (cluster.engine_metric(
        joined, "vllm:e2e_request_latency_seconds_count") or 0) >= 3, 120)
    # A prefill's connector counts for its whole life (a decode killed earlier failed one
    # of the first prefill's transfers): the drain must add no failure to either count.
    failed_before = {pod: failed_transfers(f"{cluster.pod(pod)['status']['podIP']}:9400")
                     for pod in (first, joined)}
    up = time.monotonic()
    victim = _scale_down(cluster, "prefill")
    down = time.monotonic()
    hook = _hook_lines(cluster, victim, "prefill")
    print(f"{victim} joined in {up - started:.1f} s, left in {down - up:.1f} s; completions "
          f"{dict(cluster.window(started, down))}; its hook: {hook}")
    assert hook[0].startswith("preStop: "), hook
    drained = DRAINED.fullmatch(hook[-1])
    assert drained is not None, hook
    finished, succeeded, failed = (int(group) for group in drained.groups())
    assert finished >= 3 and failed == failed_before[victim], (hook[-1], failed_before)
    assert succeeded + failed >= finished, hook[-1]
    assert set(cluster.window(started, down)) == {"identical"}
    assert sum(cluster.window(up, down).values()) > 0
    assert _router_pod(cluster) == router
    assert cluster.pdd()["spec"]["prefill"]["replicas"] == 1


def test_the_routers_own_rollout_fails_no_request(cluster: Cluster) -> None:
    """Guards against a router rollout that drops requests (docs/failure-modes.md #40): a
    change of `spec.router.args` rolls the router Deployment under the load; the new router
    is Ready before the old one stops (maxSurge 1, maxUnavailable 0), and the old one drains
    on SIGTERM: still taking requests while it lingers, then finishing those in flight."""
    old_uid, _ = _router_pod(cluster)
    old_log, = (cluster.kubelet.work_dir / cluster.namespace).glob(
        f"{NAME}-router-*-{old_uid[:8]}/router.log")
    started = time.monotonic()
    cluster.objects.patch_namespaced_custom_object(
        GROUP, VERSION, cluster.namespace, "pddeployments", NAME,
        {"spec": {"router": {"args": ["--log-level", "DEBUG"]}}})

    def rolled() -> bool:
        pods = cluster.core.list_namespaced_pod(
            cluster.namespace, label_selector=f"pd.serving.dev/deployment={NAME},"
                                              "app.kubernetes.io/component=router").items
        return [p.metadata.uid for p in pods] not in ([], [old_uid]) and old_uid not in [
            p.metadata.uid for p in pods]

    wait_for("the router rolled to a new pod and the old one gone", rolled, 180)
    wait_for("the new router serving", lambda: (cluster.router_metric(
        "pd_router_requests_total", route="/v1/completions", code="200") or 0) > 0, 60)
    done = time.monotonic()
    print(f"router rolled in {done - started:.1f} s; completions "
          f"{dict(cluster.window(started, done))}")
    assert set(cluster.window(started, done)) == {"identical"}
    assert sum(cluster.window(started, done).values()) > 0
    # The kubelet may remove the pod object before the stopping router's line is written.
    wait_for("the old router's drain in its log", lambda: "stopping: draining for up to 20 s"
             in old_log.read_text(), 30)


def _engine_rollout(cluster: Cluster) -> Obj:
    rollout: Obj = (cluster.pdd().get("status") or {}).get("rollout") or {}
    return rollout


def _engine_pods(cluster: Cluster) -> dict[str, str]:
    return engine_pods(cluster.core, cluster.namespace, NAME)


@pytest.mark.long
def test_a_revision_that_exits_at_start_rolls_back_by_itself_under_load(
        cluster: Cluster) -> None:
    """Guards against a bad revision replacing serving pods (docs/failure-modes.md #43): an
    engine argument vLLM refuses makes the new pods exit at start; the rollout judges them,
    rolls back by itself, and no serving pod was ever deleted; the load sees no failure.
    Restoring the arguments then matches the pods already running: nothing restarts.

    Marked `long` (`make test-long`): four vLLM starts that exit, 86–116 s in CI on 2
    cores. CI runs the same rollback on the reference fleet
    (`tests/e2e/test_rollout_e2e.py`) and against the real StatefulSet controller
    (`tests/integration/test_engine_rollout.py`)."""
    before = _engine_pods(cluster)
    args = cluster.pdd()["spec"]["engine"]["args"]
    started = time.monotonic()
    cluster.objects.patch_namespaced_custom_object(
        GROUP, VERSION, cluster.namespace, "pddeployments", NAME,
        {"spec": {"engine": {"args": [*args, "--no-such-engine-flag"]},
                  "rollout": {"maxRestarts": 1}}})
    back = wait_for("the rollout to roll back by itself", lambda: (
        r := _engine_rollout(cluster)).get("phase") == "RolledBack" and r, 300)
    done = time.monotonic()
    print(f"rolled back in {done - started:.1f} s: {back['message']}; completions "
          f"{dict(cluster.window(started, done))}")
    assert back["reason"] in ("CrashLoop", "StartFailed"), back
    assert set(back["failedRevisions"]) == {"prefill", "decode"}
    assert _engine_pods(cluster) == before  # the serving pods were never touched
    assert set(cluster.window(started, done)) == {"identical"}
    assert sum(cluster.window(started, done).values()) > 0
    progressing = cluster.condition("Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "RolledBack")
    cluster.objects.patch_namespaced_custom_object(
        GROUP, VERSION, cluster.namespace, "pddeployments", NAME,
        {"spec": {"engine": {"args": args}}})
    wait_for("the spec back on the running revision", lambda: _engine_rollout(cluster).get(
        "phase") == "Complete", 60)
    assert _engine_pods(cluster) == before


@pytest.mark.long
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("change", ["argument", "page size"])
def test_a_change_rolls_both_roles_under_load_with_no_failed_request(
        cluster: Cluster, change: str) -> None:
    """Guards against an engine change that fails requests (docs/failure-modes.md #41,
    #42), under the load: an engine argument (the KV-compatibility key stays: old and new
    pods may pair), then the page size of both roles (a new key: the router pairs only
    same-key pods). New pods start beside the old ones, each old pod is deleted only once a
    new pair serves and drains before it stops (its own counters: no transfer failed while
    it rolled), and every completion is the single vLLM's. Marked `long` (`make test-long`,
    not in CI): two waves of two vLLM starts beside two loaded engines take 5 to 7 minutes
    per change on 2 cores; `benchmarks/rollout_under_load.py` runs the same changes against
    the per-role rolling update."""
    if len(cluster.instances("decode")) > 1:  # run alone (`make test-long`): one per role
        _scale_down(cluster, "decode")
    old = _engine_pods(cluster)
    assert [cluster.instances(role) for role in ("decode", "prefill")] == [
        [p] for p in sorted(old)], old
    router = _router_pod(cluster)
    # The pods' connectors count for their whole life (a decode killed earlier failed a
    # transfer of the prefill's): the rollout must add no failure to that count.
    failed_before = {pod: failed_transfers(f"{cluster.pod(pod)['status']['podIP']}:9400")
                     for pod in old}
    old_key = cluster.pdd()["status"]["decode"]["kvCompat"]
    args = cluster.pdd()["spec"]["engine"].get("args") or []
    seen: list[Obj] = []
    started = time.monotonic()
    cluster.objects.patch_namespaced_custom_object(
        GROUP, VERSION, cluster.namespace, "pddeployments", NAME,
        {"spec": {"engine": {"args": [*args, "--max-num-seqs", "64"]}}
         if change == "argument" else
         {"prefill": {"pageSize": 64}, "decode": {"pageSize": 64}}})

    def complete_rollout() -> Obj | None:
        rollout = _engine_rollout(cluster)
        if rollout.get("phase") in ("Progressing", "Canary"):
            seen.append(rollout)
        return rollout if rollout.get("phase") == "Complete" and seen else None

    done_status = wait_for("the rollout to complete", complete_rollout, 900, interval_s=1.0)
    done = time.monotonic()
    now = _engine_pods(cluster)
    status = cluster.pdd()["status"]
    print(f"{change} rolled out in {done - started:.1f} s; completions "
          f"{dict(cluster.window(started, done))}; pods {sorted(now)}")
    assert set(cluster.window(started, done)) == {"identical"}
    assert sum(cluster.window(started, done).values()) > 0
    # one new instance per role, each started once (a pod per instance), none of the old
    assert len(now) == 2 and not set(now) & set(old) and not set(now.values()) & set(
        old.values()), (old, now)
    keys = {status["prefill"]["kvCompat"], status["decode"]["kvCompat"]}
    if change == "argument":
        assert keys == {old_key} and not any(r.get("keyChanged") for r in seen), seen[-1:]
    else:
        assert len(keys) == 1 and old_key not in keys
        assert any(r.get("keyChanged") for r in seen), seen[-1:]
    assert done_status["stableRevisions"] == {"prefill": status["prefill"]["revision"],
                                              "decode": status["decode"]["revision"]}
    for pod, uid in old.items():
        ended = drained(cluster.kubelet, cluster.namespace, pod, uid)
        assert ended is not None, pod
        assert ended.failed == failed_before[pod], (failed_before, ended)
        assert ended.succeeded is not None and ended.failed is not None, ended
        assert ended.succeeded + ended.failed >= ended.finished > 0, ended
    assert cluster.router_metric("pd_router_endpoints", role="prefill") == 1.0
    assert cluster.router_metric("pd_router_endpoints", role="decode") == 1.0
    assert _router_pod(cluster) == router  # new engines joined the same router


NATIVE_REFUSAL = (
    "spec.transfer.staging.prefillBufferMiB and decodePoolMiB cannot be set with "
    "spec.transfer.backend EngineNative: the vllm engine's own KV connector moves the KV and "
    "has no staging pool to resize. Remove them, or set spec.transfer.backend to PDTransfer.")


def _native_up(cluster: Cluster) -> HttpTarget:
    """The EngineNative deployment in place of the PDTransfer one (its router, serving)."""
    cluster.stop.set()  # the load and the PDTransfer deployment give the cores back
    cluster.objects.delete_namespaced_custom_object(GROUP, VERSION, cluster.namespace,
                                                    "pddeployments", NAME)
    wait_for("the PDTransfer pods gone", lambda: not cluster.core.list_namespaced_pod(
        cluster.namespace, label_selector=f"pd.serving.dev/deployment={NAME}").items, 120)
    _, pdd = manifests(cluster.namespace)
    engine_native(pdd, NATIVE)
    cluster.objects.create_namespaced_custom_object(GROUP, VERSION, cluster.namespace,
                                                    "pddeployments", pdd)
    target: HttpTarget = wait_for("the EngineNative router Ready",
                                  lambda: router_of(cluster, NATIVE), 300)
    wait_serving(cluster, NATIVE)
    first_native_request(target, cluster.expected[len(PROMPTS[0])])
    return target


def test_engine_native_serves_and_refuses_a_staging_rollout(cluster: Cluster) -> None:
    target = _native_up(cluster)
    for prompt in PROMPTS[:2]:  # NixlConnector on 2 loaded CPU cores: seconds per request
        wait_serving(cluster, NATIVE)
        started = time.monotonic()
        got = complete(target, prompt, MAX_TOKENS, timeout_s=240).token_ids
        print(f"EngineNative, {len(prompt)} tokens through the router: "
              f"{time.monotonic() - started:.1f} s")
        assert got == cluster.expected[len(prompt)]
    before = (cluster.objects.get_namespaced_custom_object(
        GROUP, VERSION, cluster.namespace, "pddeployments", NATIVE).get("status") or {})
    cluster.objects.patch_namespaced_custom_object(
        GROUP, VERSION, cluster.namespace, "pddeployments", NATIVE,
        {"spec": {"transfer": {"staging": {"decodePoolMiB": 6144}}}})

    def refused() -> Obj | None:
        status = cluster.objects.get_namespaced_custom_object(
            GROUP, VERSION, cluster.namespace, "pddeployments", NATIVE).get("status") or {}
        valid = next((c for c in status.get("conditions", []) if c["type"] == "SpecValid"), {})
        return valid if valid.get("status") == "False" else None

    valid = wait_for("SpecValid=False", refused, 60)
    assert valid["reason"] == "InvalidSpec"
    assert NATIVE_REFUSAL in valid["message"], valid["message"]
    # The operator records its Events after the status write that reported the change.
    wait_for("a Warning Event with the refusal", lambda: any(
        e.type == "Warning" and NATIVE_REFUSAL in (e.message or "")
        for e in cluster.core.list_namespaced_event(
            cluster.namespace, field_selector=f"involvedObject.name={NATIVE}").items), 30)
    after = (cluster.objects.get_namespaced_custom_object(
        GROUP, VERSION, cluster.namespace, "pddeployments", NATIVE).get("status") or {})
    assert after.get("stagingRollout") == before.get("stagingRollout")
    # Nothing was touched: the router still serves.
    wait_serving(cluster, NATIVE)
    assert complete(target, PROMPTS[0], MAX_TOKENS, timeout_s=240).token_ids == (
        cluster.expected[len(PROMPTS[0])])
    # Both pods report through their sidecars.
    # A report interval past the busy engine's late answers (its sidecar's /metrics reads
    # time out while a request runs for seconds on 2 loaded cores).
    healthy = wait_for("EngineNative TransferHealthy=True", lambda: condition_of(
        cluster, NATIVE, "TransferHealthy"), 180, until=lambda c: c.get("status") == "True")
    print(f"EngineNative transfer health: {healthy['message']}")

    def reports() -> dict[str, Obj]:
        return {a["metadata"]["name"]: a.get("status") or {} for a in cluster.agents()
                if a["spec"]["pdDeployment"] == NATIVE}

    # A sidecar reads its engine once per report interval (a busy engine answers late).
    agents = wait_for("the decode's sidecar to report the 3 transfers", lambda: (
        r if (r := reports()).get(cluster.instances("decode", NATIVE)[0], {}).get(
            "transfersTotal", 0) >= 3 else None), 120)
    assert sorted(agents) == sorted([*cluster.instances("decode", NATIVE),
                                     *cluster.instances("prefill", NATIVE)])
    assert all(s.get("healthy") is True for s in agents.values()), agents


@pytest.mark.long
@pytest.mark.timeout(1800)
def test_engine_native_argument_change_rolls_out_under_load_with_no_failed_request(
        cluster: Cluster) -> None:
    """Guards against a rollout that fails requests on vLLM's own NixlConnector
    (docs/failure-modes.md #42): an environment variable added under one client's steady
    completions through the router. New pods start beside the old, each old pod is deleted
    only once a new pair serves and drains its engine's queues in its preStop hook (KV its
    NixlConnector still holds is not visible to it), and every completion is the single
    vLLM's. Marked `long` (`make test-long`): four vLLM starts with NixlConnector beside
    loaded engines take about 10 minutes on 2 cores. Run after the test above, it finds the
    EngineNative deployment in place."""
    if not exists(cluster, NATIVE):
        _native_up(cluster)
    # The test above left a staging pool the rules refuse; without it the spec is valid.
    cluster.objects.patch_namespaced_custom_object(
        GROUP, VERSION, cluster.namespace, "pddeployments", NATIVE,
        {"spec": {"transfer": {"staging": {"decodePoolMiB": None}}}})
    wait_for("SpecValid=True", lambda: condition_of(cluster, NATIVE, "SpecValid").get(
        "status") == "True", 60)
    old = engine_pods(cluster.core, cluster.namespace, NATIVE)
    outcomes: list[Outcome] = []
    stop = threading.Event()

    client = threading.Thread(target=cluster.drive, daemon=True, args=(
        7, lambda: router_of(cluster, NATIVE)), kwargs={
        "prompts": PROMPTS[:2], "timeout_s": 240, "outcomes": outcomes, "stop": stop})
    client.start()
    seen: list[Obj] = []
    try:
        wait_for("a completion before the change", lambda: outcomes, 300)
        started = time.monotonic()
        env = cluster.objects.get_namespaced_custom_object(
            GROUP, VERSION, cluster.namespace, "pddeployments", NATIVE)["spec"]["engine"].get(
            "env") or []
        cluster.objects.patch_namespaced_custom_object(
            GROUP, VERSION, cluster.namespace, "pddeployments", NATIVE,
            {"spec": {"engine": {"env": [*env, {"name": "PD_ROLLOUT_MARK", "value": "1"}]}}})

        def complete_rollout() -> Obj | None:
            status = cluster.objects.get_namespaced_custom_object(
                GROUP, VERSION, cluster.namespace, "pddeployments", NATIVE).get("status") or {}
            rollout: Obj = status.get("rollout") or {}
            if rollout.get("phase") in ("Progressing", "Canary"):
                seen.append(rollout)
            return rollout if rollout.get("phase") == "Complete" and seen else None

        wait_for("the EngineNative rollout to complete", complete_rollout, 1500,
                 interval_s=2.0)
        done = time.monotonic()
    finally:
        stop.set()
        client.join(300)
    during = Counter(o.result for o in outcomes if started <= o.started and o.ended <= done)
    now = engine_pods(cluster.core, cluster.namespace, NATIVE)
    print(f"EngineNative argument change rolled out in {done - started:.1f} s; completions "
          f"{dict(during)}; all {dict(Counter(o.result for o in outcomes))}")
    assert set(Counter(o.result for o in outcomes)) == {"identical"}
    assert sum(during.values()) > 0
    # one new instance per role, each started once (a pod per instance), none of the old
    assert len(now) == 2 and not set(now) & set(old) and not set(now.values()) & set(
        old.values()), (old, now)
    for pod, uid in old.items():
        ended = drained(cluster.kubelet, cluster.namespace, pod, uid)
        assert ended is not None and ended.failed is None, (pod, ended)


MISMATCHED = f"{NAME}-kv-mismatch"
LOAD_S = 60


def test_engine_native_decode_with_other_kv_heads_is_reported_and_leaves_the_router(
        cluster: Cluster) -> None:
    """Guards against the fleet that looks Ready and serves nothing: the decode answers
    /health but fails every KV transfer ("compatibility hash mismatch")."""
    cluster.objects.delete_namespaced_custom_object(GROUP, VERSION, cluster.namespace,
                                                    "pddeployments", NATIVE)
    wait_for("the EngineNative pods gone", lambda: not cluster.core.list_namespaced_pod(
        cluster.namespace, label_selector=f"pd.serving.dev/deployment={NATIVE}").items, 120)
    config_map, pdd = manifests(cluster.namespace)
    config = json.loads(config_map["data"]["config.json"])
    config["num_key_value_heads"] = 4  # the decode's model: 4 KV heads, its prefill's 2
    other = {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": "tiny-llama-4kv", "namespace": cluster.namespace},
             "data": {"config.json": json.dumps(config)}}
    cluster.core.create_namespaced_config_map(cluster.namespace, other)
    spec = engine_native(pdd, MISMATCHED)
    spec["decode"]["pod"] = {
        "volumes": [{"name": "model", "configMap": {"name": "tiny-llama-4kv"}}],
        "volumeMounts": [{"name": "model", "mountPath": "/models/tiny-llama",
                          "readOnly": True}]}
    cluster.objects.create_namespaced_custom_object(GROUP, VERSION, cluster.namespace,
                                                    "pddeployments", pdd)
    decode: str = wait_for("the mismatched decode's pod", lambda: next(
        iter(cluster.instances("decode", MISMATCHED)), None), 60)
    wait_for(f"{decode} Running with its sidecar", lambda: cluster.podcondition_of(
        decode, "ContainersReady").get("status") == "True", 300)
    wait_for("the router has the prefill and the decode", lambda: router_of(
        cluster, MISMATCHED) is not None, 120)
    router = router_of(cluster, MISMATCHED)
    assert router is not None
    started = time.monotonic()
    answers = Counter()
    # Requests for up to LOAD_S, then none: a sidecar sees the failures at its first
    # reading after them, and they stay in the 60 s window. Without the load the 2 cores
    # serve the control plane again (with it the API server's reads took 30 s).
    while time.monotonic() - started < LOAD_S and condition_of(
            cluster, MISMATCHED, "TransferHealthy").get("status") != "False":
        try:
            complete(router, PROMPTS[1], MAX_TOKENS, timeout_s=60)
            answers["ok"] += 1
        except RuntimeError as exc:
            answers[str(exc).split(":")[0]] += 1
    unhealthy = wait_for("TransferHealthy=False", lambda: condition_of(
        cluster, MISMATCHED, "TransferHealthy"), 180, until=lambda c: c.get("status") == "False")
    noticed = time.monotonic() - started
    print(f"mismatched decode: answers {dict(answers)}; TransferHealthy=False after "
          f"{noticed:.1f} s: {unhealthy['reason']}: {unhealthy['message']}")
    assert answers["ok"] == 0, answers
    assert decode in unhealthy["message"]
    # Its sidecar counts the requests vLLM ended with an error (finished_reason "error",
    # the HTTP 500s) among those it ended. An engine rollout rolls back on them.
    window = wait_for(f"{decode}'s report to count its request errors", lambda: next(
        ((a.get("status") or {}).get("window") or {} for a in cluster.agents()
         if a["metadata"]["name"] == decode), {}), 60,
        until=lambda w: (w.get("requestErrors") or 0) > 0)
    assert window["requests"] >= window["requestErrors"], window
    gate = wait_for(f"{decode}'s transfer gate False", lambda: (
        g if (g := cluster.podcondition_of(decode, "pd.serving.dev/transfer-ready")).get(
            "status") == "False" else None), 120)
    assert decode in gate.get("message", "") or gate.get("reason")
    events = cluster.core.list_namespaced_event(
        cluster.namespace, field_selector=f"involvedObject.name={MISMATCHED}").items
    assert any(e.type == "Warning" and decode in (e.message or "") for e in events)
    wait_for("the router without a decode engine", lambda: cluster.router_metric_of(
        MISMATCHED, "pd_router_endpoints", role="decode") == 0.0, 120)


