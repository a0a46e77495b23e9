"""The operator as its own process (`pd-operator run`), as the chart runs it: for the tests
that kill it (SIGKILL, SIGTERM) and run several replicas under leader election, where the
in-process runner of `operator_runner` cannot stand in (one kopf registry and one metrics
registry per process).

`OperatorProcess.start` serves one namespace of a control plane with the Lease in that
namespace; `metrics()` reads its Prometheus endpoint, `leads()` and `writes()` the two
figures the tests judge it by. Its log is kept in a file and shown when it fails to start.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pd_devcluster import ControlPlaneHandle
from pd_testbed.checkout import REPO_ROOT
from pd_testbed.polling import wait_for

__all__ = ["LEASE", "QUICK_TAKEOVER", "TEST_TUNING", "OperatorProcess", "OperatorReplicas"]

LEASE = "pd-operator"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _source_path(source: Path | None) -> dict[str, str]:
    if source is None:
        return {}
    paths = [str(source / "operator"), str(source / "contract")]
    return {"PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}


@dataclass
class OperatorProcess:
    """One `pd-operator run --leader-elect` process serving `namespace`."""

    name: str
    namespace: str
    process: subprocess.Popen[bytes]
    metrics_port: int
    health_port: int
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, control_plane: ControlPlaneHandle, namespace: str, name: str,
              log_dir: Path, *, kubeconfig: Path | None = None,
              extra_args: Sequence[str] = (), all_namespaces: bool = False,
              source: Path | None = None) -> OperatorProcess:
        """`kubeconfig`: whose credentials it runs with (default: the admin's).
        `all_namespaces`: serve every namespace (`-A`), `namespace` holding only the Lease.
        `source`: another checkout whose operator to run (a benchmark's before: its
        `operator/` and `contract/` first on the path), instead of this one's."""
        port, health_port = _free_port(), _free_port()
        log_path = log_dir / f"operator-{name}.log"
        scope = ["-A"] if all_namespaces else ["--namespace", namespace]
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "pd_operator.cli", "run", *scope,
                 "--kubeconfig", str(kubeconfig or control_plane.kubeconfig_path),
                 "--metrics-port", str(port), "--leader-elect",
                 "--liveness", f"http://127.0.0.1:{health_port}/healthz",
                 "--leader-elect-namespace", namespace, "--leader-elect-name", LEASE,
                 *extra_args],
                stdout=log, stderr=subprocess.STDOUT, cwd=source or REPO_ROOT,
                env={**os.environ, "HOSTNAME": name, **_source_path(source)},
            )
        operator = cls(name, namespace, process, port, health_port, log_path)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"operator {name} exited {process.returncode}:\n"
                                   f"{operator.log()}")
            try:
                operator.metrics()
                return operator
            except OSError:
                time.sleep(0.2)
        operator.kill()
        raise RuntimeError(f"operator {name} served no metrics in 60 s:\n{operator.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def notable(self, lines: int = 30) -> str:
        """The operator's own log lines but DEBUG, the last `lines` of them, each cut to 300
        characters: what a failed wait shows of why the operator did not get there."""
        own = [line[:300] for line in self.log_path.read_text(errors="replace").splitlines()
               if " pd_operator." in line and " DEBUG " not in line]
        return "\n".join(own[-lines:])

    def metrics(self) -> dict[str, float]:
        """Every sample as `name{label=value,...}` (labels sorted) -> value."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=5) as response:
            text = response.read().decode()
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}"] = sample.value
        return samples

    def health(self) -> tuple[int, object]:
        """Its liveness endpoint's answer (as the kubelet probes it): status and JSON body."""
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=15) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as refused:
            return refused.code, refused.read().decode(errors="replace")

    def leads(self) -> bool:
        key = (f"pd_operator_leader_election_master_status{{name={self.namespace}/{LEASE}}}")
        return self.metrics().get(key) == 1.0

    def counter(self, prefix: str) -> float:
        """The sum of every sample whose `name{labels}` starts with `prefix`."""
        return sum(v for k, v in self.metrics().items() if k.startswith(prefix))

    def writes(self) -> float:
        """Writes it sent to the API server, every kind but its Lease (counted apart)."""
        return sum(v for k, v in self.metrics().items()
                   if k.startswith("pd_operator_api_writes_total{") and "kind=Lease" not in k)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no cleanup, the Lease is left to expire."""
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def terminate(self, timeout_s: float = 30) -> int:
        """SIGTERM, as the kubelet stops a pod: the operator releases its Lease."""
        if self.alive:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)


# Leader election timing for tests that kill leaders: a takeover after SIGKILL costs ~5 s
# (lease 4 s, retry 1 s) rather than the chart's ~12 s.
QUICK_TAKEOVER = ("--leader-elect-lease-seconds", "4", "--leader-elect-renew-deadline-seconds",
                  "3", "--leader-elect-retry-seconds", "1")
# A queue tuned for tests: status refreshes at most once a second, a resync every second.
TEST_TUNING = ("--status-interval-seconds", "1", "--resync-seconds", "1")


@dataclass
class OperatorReplicas:
    """Operator processes serving one namespace under leader election, kept at `count` as
    the chart's Deployment keeps its replicas: `kill_leader()` SIGKILLs whichever leads and
    starts a replacement, which joins as a standby."""

    control_plane: ControlPlaneHandle
    namespace: str
    log_dir: Path
    count: int = 2
    extra_args: Sequence[str] = (*QUICK_TAKEOVER, *TEST_TUNING)
    source: Path | None = None  # another checkout's operator (`OperatorProcess.start`)
    started: list[OperatorProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        for _ in range(self.count):
            self._start()

    def _start(self) -> OperatorProcess:
        self.started.append(OperatorProcess.start(
            self.control_plane, self.namespace, f"replica-{len(self.started)}", self.log_dir,
            extra_args=self.extra_args, source=self.source))
        return self.started[-1]

    @property
    def live(self) -> list[OperatorProcess]:
        return [p for p in self.started if p.alive]

    def leader(self, timeout_s: float = 15.0) -> OperatorProcess:
        """The replica that leads, once one does."""
        leading: OperatorProcess = wait_for(
            f"a replica of {self.namespace} to lead",
            lambda: next((p for p in self.live if p.leads()), None), timeout_s, 0.05)
        return leading

    def kill_leader(self, *, replace: bool = True) -> OperatorProcess:
        """SIGKILL the leader (once there is one) and start its replacement; the killed.
        Starting one takes seconds (it serves once it has imported and logged in), longer
        than a takeover on a busy machine: a test that looks at what happens while no
        replica leads passes `replace=False` and calls `add_replica()` after looking."""
        leader = self.leader()
        leader.kill()
        if replace:
            self.add_replica()
        return leader

    def add_replica(self) -> OperatorProcess:
        """Start one more replica, as the Deployment replaces a lost pod: it joins as a
        standby (or leads, once the Lease is free)."""
        return self._start()

    def stop(self) -> str:
        """SIGTERM every replica still running (SIGKILL after 10 s); their logs, for a
        failed test to show."""
        for process in self.live:
            try:
                process.terminate(timeout_s=10)
            except subprocess.TimeoutExpired:
                process.kill()
        return "\n".join(f"--- operator {p.name} ---\n{p.log()}" for p in self.started)

    def errors(self) -> list[str]:
        """ERROR lines and tracebacks in every replica's log, but kopf's own reports of an
        API request it retries (a busy API server timing out a watch: kopf logs them at
        ERROR and recovers by itself)."""
        found = []
        for process in self.started:
            for line in process.log_path.read_text(errors="replace").splitlines():
                if "kopf._cogs.clients" in line and "will retry" in line:
                    continue
                if " ERROR " in line or line.startswith("Traceback"):
                    found.append(line)
        return found
