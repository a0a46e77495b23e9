"""Engine rollouts under load (not a test): the strategies of `--strategies` in the same run
(the coordinated surge rollout, `spec.rollout.strategy: Surge`, the default; `RollingUpdate`,
one instance of a role at a time); with `--before REF`, each strategy first with REF's
operator and CRDs (a git worktree of REF: the previous release), then with this checkout's,
each on a fresh control plane.

On a fresh local control plane: the operator (its own process), the fake kubelet running
`examples/local-vllm.yaml` (one vLLM prefill and one vLLM decode on PDTransferConnector, the
router in front) and `--clients` clients sending greedy completions of `--max-tokens`
tokens for prompts of 7 to 700 tokens through the router, back to back, never paused. Per
strategy, on a fresh PDDeployment: `--before-seconds` of load, then two changes in turn,
each awaited until every pod runs the new revision and the router has a prefill and a
decode again:
- `args`: an engine argument (`--max-num-seqs 64`), which leaves the KV-compatibility key;
- `key`: the page size of both roles (32 → 64 tokens), which moves it.

Per change: seconds from the patch to the end, completions served and failed that were in
flight at some point of that window (by error; while no router is Ready, as when a role has
no engine, each client counts one refusal per second, as a client of the router's Service
would be refused), their latency p50/p99, the longest stretch without an answer, and the
engines started for it (engine pods created, and engine process starts: those pods' first
starts plus their container restarts), beside the same figures for the window before the
first change.

With `--upgrade-from REF` (instead of the strategies): the example deployed by REF's
operator and CRDs (the previous release, whose children are a StatefulSet per role), load
for `--before-seconds`, then that operator replaced by this checkout's under the load (as
`helm upgrade` does: stopped, CRDs applied, started), awaited until no StatefulSet is left
and one instance per role serves; the same figures for that window.

Printed and saved as JSON under benchmarks/results/. Run:
`.venv/bin/python benchmarks/rollout_under_load.py` (`--before REF --strategies Surge` took 9
minutes on 2 cores, `--upgrade-from REF` 4). Needs the vLLM virtualenv (`python -m
pd_devcluster.vllm_env`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "devtools"))  # pd_testbed, pd_devcluster
sys.path.insert(0, str(REPO / "benchmarks"))

from git_trees import worktree  # noqa: E402
from kubernetes import client as k8s  # noqa: E402
from scale_drain_cpu import GROUP, NAME, VERSION, Fleet, local_fleet, save_results  # noqa: E402

from pd_devcluster.vllm_env import require_vllm_env  # noqa: E402
from pd_testbed.polling import wait_for  # noqa: E402

Obj = dict[str, Any]
# The changes in turn; "args" appends to the example's own arguments (run_strategy).
CHANGES: dict[str, Obj] = {
    "args": {},
    "key": {"prefill": {"pageSize": 64}, "decode": {"pageSize": 64}},
}


def latency(fleet: Fleet, start: float, end: float) -> dict[str, Any]:
    """Served and failed completions in flight at some point of [start, end], and the
    served ones' latency quantiles."""
    hits = [o for o in list(fleet.outcomes) if o.started <= end and o.ended >= start]
    served = sorted(o.ended - o.started for o in hits if o.error is None)
    errors = Counter(o.error for o in hits if o.error is not None)
    # the longest stretch of the window in which no completion was answered
    ends = sorted(o.ended for o in hits if o.error is None and start <= o.ended <= end)
    marks = [start, *ends, end]
    gap = max(b - a for a, b in pairwise(marks))

    def pct(q: float) -> float | None:
        if not served:
            return None
        return round(statistics.quantiles(served, n=100)[int(q) - 1], 3) if len(served) > 1 \
            else round(served[0], 3)
    return {"served": len(served), "failed": sum(errors.values()), "errors": dict(errors),
            "p50_s": pct(50), "p99_s": pct(99), "longest_without_an_answer_s": round(gap, 1)}


def settled(fleet: Fleet, generation: int) -> bool:
    """Every engine pod runs the status's revision of its role, one pod per role, the
    status is of `generation`, and the router has a prefill and a decode."""
    pdd = cast(Obj, fleet.objects.get_namespaced_custom_object(
        GROUP, VERSION, fleet.namespace, "pddeployments", NAME))
    status: Obj = pdd.get("status") or {}
    if status.get("observedGeneration") != generation:
        return False
    listed: Obj = fleet.api.sanitize_for_serialization(  # type: ignore[no-untyped-call]
        fleet.core.list_namespaced_pod(
            fleet.namespace, label_selector=f"pd.serving.dev/deployment={NAME},"
                                            "pd.serving.dev/role in (prefill,decode)"))
    for role in ("prefill", "decode"):
        mine = [p["metadata"] for p in listed["items"]
                if p["metadata"]["labels"]["pd.serving.dev/role"] == role]
        want = (status.get(role) or {}).get("revision")
        if len(mine) != 1 or mine[0]["labels"].get("pd.serving.dev/template-hash") != want \
                or mine[0].get("deletionTimestamp"):
            return False
    return fleet.endpoints("prefill") == 1.0 and fleet.endpoints("decode") == 1.0


class EngineStarts(threading.Thread):
    """Samples the engine pods twice a second: the pods created since it started (new
    uids) and the most restarts each of those had."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(daemon=True)
        self.fleet = fleet
        self.known = {uid for uid, _ in self._pods()}
        self.created: dict[str, int] = {}
        self.done = threading.Event()

    def _pods(self) -> list[tuple[str, int]]:
        listed: Obj = self.fleet.api.sanitize_for_serialization(  # type: ignore[no-untyped-call]
            self.fleet.core.list_namespaced_pod(
                self.fleet.namespace, label_selector=f"pd.serving.dev/deployment={NAME},"
                                                     "pd.serving.dev/role in (prefill,decode)"))
        return [(p["metadata"]["uid"], sum(int(c.get("restartCount") or 0) for c in (
            p.get("status") or {}).get("containerStatuses") or [])) for p in listed["items"]]

    def run(self) -> None:
        while not self.done.wait(0.5):
            for uid, restarts in self._pods():
                if uid not in self.known:
                    self.created[uid] = max(restarts, self.created.get(uid, 0))

    def stop(self) -> dict[str, int]:
        self.done.set()
        self.join(10)
        return {"engine_pods_created": len(self.created),
                "engine_process_starts": len(self.created) + sum(self.created.values())}


def run_strategy(fleet: Fleet, strategy: str, clients: int, before_s: float) -> Obj:
    def edit(pdd: Obj) -> None:
        pdd["spec"]["rollout"] = {"strategy": strategy}

    args = list(fleet.deploy(edit)["spec"]["engine"]["args"])
    drivers = fleet.start_load(clients)
    start = time.monotonic()
    time.sleep(before_s)
    result: Obj = {"before": latency(fleet, start, time.monotonic())}
    generation = 1
    for change, given in CHANGES.items():
        patch = {"engine": {"args": [*args, "--max-num-seqs", "64"]}} if change == "args" \
            else given
        starts = EngineStarts(fleet)
        starts.start()
        began = time.monotonic()
        fleet.objects.patch_namespaced_custom_object(GROUP, VERSION, fleet.namespace,
                                                     "pddeployments", NAME, {"spec": patch})
        generation += 1
        wait_for(f"the {change} change rolled out", partial(settled, fleet, generation),
                 900, interval_s=1.0)
        ended = time.monotonic()
        time.sleep(3)  # completions cut at the end have ended and are counted
        result[change] = {"rollout_s": round(ended - began, 1),
                          **latency(fleet, began, ended), **starts.stop()}
        print(strategy, change, json.dumps(result[change]), flush=True)
    fleet.undeploy(drivers)
    return result


def upgraded(fleet: Fleet, legacy: set[str]) -> bool:
    """No StatefulSet of the PDDeployment is left, its engine pods are one instance per
    role, none of them a `legacy` pod, the engine rollout is Complete, and the router has a
    prefill and a decode."""
    selector = f"pd.serving.dev/deployment={NAME}"
    if k8s.AppsV1Api(fleet.api).list_namespaced_stateful_set(
            fleet.namespace, label_selector=selector).items:
        return False
    pdd = cast(Obj, fleet.objects.get_namespaced_custom_object(
        GROUP, VERSION, fleet.namespace, "pddeployments", NAME))
    if ((pdd.get("status") or {}).get("rollout") or {}).get("phase") != "Complete":
        return False
    listed: Obj = fleet.api.sanitize_for_serialization(  # type: ignore[no-untyped-call]
        fleet.core.list_namespaced_pod(
            fleet.namespace, label_selector=f"{selector},pd.serving.dev/role in (prefill,decode)"))
    pods = [p["metadata"] for p in listed["items"]]
    if any(p.get("deletionTimestamp") or p["name"] in legacy
           or "pd.serving.dev/instance" not in p["labels"] for p in pods):
        return False
    if sorted(p["labels"]["pd.serving.dev/role"] for p in pods) != ["decode", "prefill"]:
        return False
    return fleet.endpoints("prefill") == 1.0 and fleet.endpoints("decode") == 1.0


def run_upgrade(fleet: Fleet, clients: int, before_s: float) -> Obj:
    """The example deployed by the fleet's (previous release's) operator, load, then that
    operator replaced by this checkout's (`Fleet.upgrade_operator`), awaited until the
    previous release's children are gone and instances serve (`upgraded`)."""
    fleet.deploy(lambda pdd: None)
    drivers = fleet.start_load(clients)
    start = time.monotonic()
    time.sleep(before_s)
    result: Obj = {"before": latency(fleet, start, time.monotonic())}
    listed: Obj = fleet.api.sanitize_for_serialization(  # type: ignore[no-untyped-call]
        fleet.core.list_namespaced_pod(fleet.namespace,
                                       label_selector=f"pd.serving.dev/deployment={NAME}"))
    legacy = {str(p["metadata"]["name"]) for p in listed["items"]}
    starts = EngineStarts(fleet)
    starts.start()
    began = time.monotonic()
    fleet.upgrade_operator()
    wait_for("the previous release's children replaced by instances",
             partial(upgraded, fleet, legacy), 900, interval_s=1.0)
    ended = time.monotonic()
    time.sleep(3)  # completions cut at the end have ended and are counted
    result["upgrade"] = {"upgrade_s": round(ended - began, 1), **latency(fleet, began, ended),
                         **starts.stop()}
    print("upgrade", json.dumps(result["upgrade"]), flush=True)
    fleet.undeploy(drivers)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--before-seconds", type=float, default=30.0)
    parser.add_argument("--strategies", default="Surge,RollingUpdate")
    parser.add_argument("--before", default="",
                        help="a git ref: run each strategy with its operator first")
    parser.add_argument("--upgrade-from", default="",
                        help="a git ref (a previous release): deploy with its operator and "
                             "CRDs, then upgrade to this checkout's under load (instead of "
                             "the strategies)")
    args = parser.parse_args()
    require_vllm_env()
    results: Obj = {}
    if args.upgrade_from:
        with worktree(args.upgrade_from) as previous, local_fleet(
                "rollout-upgrade", "127.203.9.", args.max_tokens, source=previous) as fleet:
            results["upgrade"] = run_upgrade(fleet, args.clients, args.before_seconds)
        print(json.dumps(results, indent=1))
        save_results("rollout_under_load", vars(args), results)
        return 0
    with ExitStack() as stack:
        sources: dict[str, Path | None] = {"after": None}
        if args.before:
            sources = {"before": stack.enter_context(worktree(args.before)), **sources}
        for label, source in sources.items():
            with local_fleet("rollout-load", "127.203.9.", args.max_tokens,
                             source=source) as fleet:
                for strategy in args.strategies.split(","):
                    key = f"{label}/{strategy}" if args.before else strategy
                    results[key] = run_strategy(fleet, strategy, args.clients,
                                                args.before_seconds)
    if args.before:
        for strategy in args.strategies.split(","):
            for change in CHANGES:
                before = results[f"before/{strategy}"][change]["rollout_s"]
                after = results[f"after/{strategy}"][change]["rollout_s"]
                results.setdefault("after_over_before", {})[f"{strategy}/{change}"] = round(
                    after / before, 2)
    print(json.dumps(results, indent=1))
    save_results("rollout_under_load", vars(args), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
