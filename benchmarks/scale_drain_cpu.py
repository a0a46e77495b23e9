"""Scaling each role up and down under load, with the engines' drain and without it (not a
test): what the traffic sees while a prefill or a decode pod leaves, and how long it takes.

On a fresh local control plane: the operator (its own process), the fake kubelet running
`examples/local-vllm.yaml` (one vLLM prefill, one vLLM decode on PDTransferConnector, the
router in front) and `--clients` clients sending greedy completions of `--max-tokens`
tokens for prompts of 7 to 700 tokens, back to back. Per mode, per role: scale the role's
PDRole 1 → 2 (load paused while the new engine starts: on 2 cores a vLLM start beside two
loaded engines takes minutes), let the new pod serve for `--serve-seconds`, then 2 → 1;
`--cycles` times.

Modes:
- `drain`: the PDDeployment as shipped: the leaving pod's preStop hook (`pd-transfer
  drain`) holds SIGTERM until its engine has no request and, on prefill, no KV waiting for
  decode (`spec.<role>.drainSeconds` default);
- `no-drain`: `spec.<role>.drainSeconds: 0`, which is the behaviour before the hook
  existed: SIGTERM the moment the pod is deleted.

Per scale-down: seconds from the PDRole patch to the engine process gone, the hook's own
drain time (its last line), and the completions that overlapped that window (started
before the engine was gone, ended after the patch): served (200, token ids of the expected
length) and failed (by error). Printed and saved as JSON under benchmarks/results/.
Run: `.venv/bin/python benchmarks/scale_drain_cpu.py` (about 25 minutes on 2 cores). Needs
the vLLM virtualenv (`python -m pd_devcluster.vllm_env`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "devtools"))  # pd_testbed, pd_devcluster

from kubernetes import client as k8s  # noqa: E402

from pd_devcluster import ControlPlaneHandle, Ports, apply_crds, start_control_plane  # noqa: E402
from pd_devcluster.kubelet import FakeKubelet  # noqa: E402
from pd_devcluster.vllm_env import require_vllm_env  # noqa: E402
from pd_testbed.operator_process import OperatorReplicas  # noqa: E402
from pd_testbed.polling import wait_for  # noqa: E402
from pd_testbed.rollout_harness import FLEET_OPERATOR  # noqa: E402
from pd_testbed.vllm import HttpTarget, complete, prompt_ids, scrape  # noqa: E402

GROUP, VERSION = "pd.serving.dev", "v1alpha1"
NAME = "local-vllm"
EXAMPLE = REPO / "examples" / "local-vllm.yaml"
PROMPTS = [prompt_ids(n, seed=7000 + n) for n in (7, 150, 300, 700)]
DRAINED = re.compile(r"drained (prefill|decode) after ([0-9.]+) s")
Obj = dict[str, Any]


@dataclass
class Outcome:
    started: float
    ended: float
    error: str | None


@dataclass
class Fleet:
    api: k8s.ApiClient
    namespace: str
    kubelet: FakeKubelet
    max_tokens: int
    handle: ControlPlaneHandle
    work: Path
    operator: OperatorReplicas
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    paused: threading.Event = field(default_factory=threading.Event)

    @property
    def core(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.api)

    @property
    def objects(self) -> k8s.CustomObjectsApi:
        return k8s.CustomObjectsApi(self.api)

    def router(self) -> HttpTarget | None:
        """A Ready, non-terminating router pod (what the Service would pick)."""
        pods = self.api.sanitize_for_serialization(  # type: ignore[no-untyped-call]
            self.core.list_namespaced_pod(
                self.namespace, label_selector=f"pd.serving.dev/deployment={NAME},"
                                               "app.kubernetes.io/component=router"))
        for pod in pods["items"]:
            status = pod.get("status") or {}
            ready = any(c["type"] == "Ready" and c["status"] == "True"
                        for c in status.get("conditions") or [])
            if status.get("podIP") and ready and not pod["metadata"].get("deletionTimestamp"):
                return HttpTarget("router", status["podIP"], 8000)
        return None

    def endpoints(self, role: str) -> float | None:
        router = self.router()
        return None if router is None else scrape(f"{router.host}:{router.port}",
                                                  "pd_router_endpoints", role=role)

    def drive(self, seed: int) -> None:
        """Completions back to back through a Ready router. While none is Ready (not
        paused), a client of the router's Service would be refused: one failed outcome per
        second says so."""
        rng = random.Random(seed)
        while not self.stop.is_set():
            if self.paused.is_set():
                time.sleep(0.2)
                continue
            router = self.router()
            if router is None:
                started = time.monotonic()
                time.sleep(1.0)
                self.outcomes.append(Outcome(started, time.monotonic(),
                                             "no Ready router: the Service has no endpoint"))
                continue
            started = time.monotonic()
            error = None
            try:
                got = complete(router, rng.choice(PROMPTS), self.max_tokens, timeout_s=120)
                if len(got.token_ids) != self.max_tokens:
                    error = f"{len(got.token_ids)} tokens"
            except Exception as exc:  # what the client sees is the measure
                error = f"{type(exc).__name__}: {str(exc)[:100]}"
            self.outcomes.append(Outcome(started, time.monotonic(), error))

    def overlapping(self, start: float, end: float) -> dict[str, Any]:
        """Completions in flight at some point of [start, end]."""
        hits = [o for o in list(self.outcomes) if o.started <= end and o.ended >= start]
        errors = Counter(o.error for o in hits if o.error is not None)
        return {"served": sum(1 for o in hits if o.error is None),
                "failed": sum(errors.values()), "errors": dict(errors)}

    def scale(self, role: str, replicas: int) -> None:
        self.objects.patch_namespaced_custom_object_scale(
            GROUP, VERSION, self.namespace, "pdroles", f"{NAME}-{role}",
            {"spec": {"replicas": replicas}})

    def deploy(self, edit: Callable[[Obj], None]) -> Obj:
        """`examples/local-vllm.yaml` in this namespace, its PDDeployment changed by `edit`;
        returns it once its router is Ready."""
        config_map, pdd = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
        for obj in (config_map, pdd):
            obj["metadata"]["namespace"] = self.namespace
        edit(pdd)
        try:
            self.core.create_namespaced_config_map(self.namespace, config_map)
        except k8s.ApiException as exc:
            if exc.status != 409:
                raise
        self.objects.create_namespaced_custom_object(GROUP, VERSION, self.namespace,
                                                     "pddeployments", pdd)
        wait_for("the router Ready", self.router, 420)
        return cast(Obj, pdd)

    def start_load(self, clients: int) -> list[threading.Thread]:
        """`clients` drivers from a clean record, after 10 s of warm-up."""
        self.outcomes.clear()
        self.stop.clear()
        drivers = [threading.Thread(target=self.drive, args=(seed,), daemon=True)
                   for seed in range(clients)]
        for thread in drivers:
            thread.start()
        time.sleep(10)
        return drivers

    def undeploy(self, drivers: list[threading.Thread]) -> None:
        """Stop the load, delete the PDDeployment, wait until every engine is gone."""
        self.stop.set()
        for thread in drivers:
            thread.join(150)
        self.objects.delete_namespaced_custom_object(GROUP, VERSION, self.namespace,
                                                     "pddeployments", NAME)
        wait_for("every engine gone", lambda: not self.core.list_namespaced_pod(
            self.namespace, label_selector=f"pd.serving.dev/deployment={NAME}").items, 600)

    def upgrade_operator(self) -> None:
        """Replace the operator with this checkout's, as `helm upgrade` does: the running
        one stopped (SIGTERM), this checkout's CRDs applied, this checkout's operator
        started (its log under `work/upgraded`)."""
        self.operator.stop()
        apply_crds(self.api, REPO / "crds")
        logs = self.work / "upgraded"
        logs.mkdir(exist_ok=True)
        self.operator = OperatorReplicas(self.handle, self.namespace, logs, count=1,
                                         extra_args=FLEET_OPERATOR)

    def hook_drain_s(self, pod: str) -> float | None:
        logs = sorted((self.kubelet.work_dir / self.namespace).glob(f"{pod}-*/engine.log"),
                      key=lambda path: path.stat().st_mtime)  # the incarnation that left last
        found = DRAINED.findall(logs[-1].read_text()) if logs else []
        return float(found[-1][1]) if found else None


def scale_cycle(fleet: Fleet, role: str, serve_s: float) -> dict[str, Any]:
    victim = f"{NAME}-{role}-1"
    fleet.paused.set()
    up = time.monotonic()
    try:
        fleet.scale(role, 2)
        wait_for(f"two {role} engines in the router", lambda: fleet.endpoints(role) == 2.0,
                 420)
    finally:
        fleet.paused.clear()
    joined = time.monotonic()
    time.sleep(serve_s)
    down = time.monotonic()
    fleet.scale(role, 1)
    wait_for(f"{victim}'s engine gone", lambda: fleet.kubelet.process_of(
        fleet.namespace, victim) is None, 600)
    gone = time.monotonic()
    time.sleep(3)  # requests cut at the end have ended and are counted
    return {
        "scale_up_to_serving_s": round(joined - up, 1),
        "scale_down_to_engine_gone_s": round(gone - down, 1),
        "hook_drain_s": fleet.hook_drain_s(victim),
        "while_leaving": fleet.overlapping(down, gone),
        "while_serving_with_two": fleet.overlapping(joined, down),
    }


def summary(cycles: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over a role's cycles: completions served and failed while a pod left, and
    the scale-down times."""
    leaving = [c["while_leaving"] for c in cycles]
    errors: Counter[str] = Counter()
    for window in leaving:
        errors.update(window["errors"])
    return {
        "cycles": len(cycles),
        "served_while_leaving": sum(w["served"] for w in leaving),
        "failed_while_leaving": sum(w["failed"] for w in leaving),
        "errors": dict(errors),
        "scale_down_to_engine_gone_s": [c["scale_down_to_engine_gone_s"] for c in cycles],
        "hook_drain_s": [c["hook_drain_s"] for c in cycles],
    }


def run_mode(fleet: Fleet, mode: str, clients: int, serve_s: float,
             cycles: int) -> dict[str, Any]:
    def edit(pdd: Obj) -> None:
        if mode == "no-drain":
            for role in ("prefill", "decode"):
                pdd["spec"][role]["drainSeconds"] = 0

    fleet.deploy(edit)
    drivers = fleet.start_load(clients)
    result: dict[str, Any] = {}
    for role in ("prefill", "decode"):
        runs = [scale_cycle(fleet, role, serve_s) for _ in range(cycles)]
        result[role] = {"summary": summary(runs), "runs": runs}
    fleet.undeploy(drivers)
    return result


@contextmanager
def local_fleet(prefix: str, ip_prefix: str, max_tokens: int, *,
                source: Path | None = None) -> Iterator[Fleet]:
    """A fresh local control plane, the operator (its own process) and the fake kubelet
    serving one new namespace (`prefix-…`, pods on `ip_prefix`*); everything stops after.
    `source`: another checkout whose operator and CRDs to run (a before/after's before); the
    engines run this checkout's pd_transfer either way."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    work = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    handle = start_control_plane(work / "cluster", Ports.free(), (source or REPO) / "crds",
                                 controller_manager=True)
    try:
        api = handle.api_client()
        core = k8s.CoreV1Api(api)
        created = core.create_namespace(k8s.V1Namespace(
            metadata=k8s.V1ObjectMeta(generate_name=f"{prefix}-")))
        namespace = str(api.sanitize_for_serialization(created)["metadata"]["name"])  # type: ignore[no-untyped-call]
        operator = OperatorReplicas(handle, namespace, work, count=1,
                                    extra_args=FLEET_OPERATOR, source=source)
        kubelet = FakeKubelet(handle, work / "kubelet", namespace=namespace,
                              ip_prefix=ip_prefix, restart_backoff_s=2.0)
        kubelet_stop = threading.Event()
        kubelet_thread = threading.Thread(target=kubelet.run, args=(kubelet_stop, 0.5),
                                          daemon=True)
        kubelet_thread.start()
        fleet = Fleet(api, namespace, kubelet, max_tokens, handle, work, operator)
        try:
            yield fleet
        finally:
            kubelet_stop.set()
            kubelet_thread.join(120)
            fleet.operator.stop()
    finally:
        handle.stop()


def save_results(benchmark: str, settings: dict[str, Any], results: dict[str, Any]) -> Path:
    """Write `benchmarks/results/<benchmark>-<UTC time>.json` (host, settings, results)."""
    record = {
        "benchmark": benchmark,
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "settings": settings,
        "results": results,
    }
    out = REPO / "benchmarks" / "results" / f"{benchmark}-{datetime.now(UTC):%Y%m%d-%H%M%S}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO)}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cycles", type=int, default=3, help="1 -> 2 -> 1 per role and mode")
    parser.add_argument("--serve-seconds", type=float, default=15.0)
    parser.add_argument("--modes", default="no-drain,drain")
    args = parser.parse_args()
    require_vllm_env()
    results: dict[str, Any] = {}
    with local_fleet("scale-drain", "127.201.7.", args.max_tokens) as fleet:
        for mode in args.modes.split(","):
            results[mode] = run_mode(fleet, mode, args.clients, args.serve_seconds,
                                     args.cycles)
            print(mode, json.dumps({role: results[mode][role]["summary"]
                                    for role in ("prefill", "decode")}, indent=1),
                  flush=True)
    save_results("scale_drain_cpu", vars(args), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
