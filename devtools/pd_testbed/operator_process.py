"""The operator as its own process (`pd-operator run`), as the chart runs it: for the tests
that kill it (SIGKILL, SIGTERM) and run several replicas under leader election, where the
in-process runner of `operator_runner` cannot stand in (one kopf registry and one metrics
registry per process).

`OperatorProcess.start` serves one namespace of a control plane with the Lease in that
namespace; `metrics()` reads its Prometheus endpoint, `leads()` and `writes()` the two
figures the tests judge it by. Its log is kept in a file and shown when it fails to start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pd_devcluster import ControlPlaneHandle
from pd_testbed.checkout import REPO_ROOT

__all__ = ["LEASE", "OperatorProcess"]

LEASE = "pd-operator"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class OperatorProcess:
    """One `pd-operator run --leader-elect` process serving `namespace`."""

    name: str
    namespace: str
    process: subprocess.Popen[bytes]
    metrics_port: int
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, control_plane: ControlPlaneHandle, namespace: str, name: str,
              log_dir: Path, *, kubeconfig: Path | None = None,
              extra_args: Sequence[str] = ()) -> OperatorProcess:
        """`kubeconfig`: whose credentials it runs with (default: the admin's)."""
        port = _free_port()
        log_path = log_dir / f"operator-{name}.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "pd_operator.cli", "run", "--namespace", namespace,
                 "--kubeconfig", str(kubeconfig or control_plane.kubeconfig_path),
                 "--metrics-port", str(port), "--leader-elect",
                 "--leader-elect-namespace", namespace, "--leader-elect-name", LEASE,
                 *extra_args],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                env={**os.environ, "HOSTNAME": name},
            )
        operator = cls(name, namespace, process, port, log_path)
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
