"""The operator in-process under kopf's test runner, leaving no sockets behind.

`run_operator` serves one namespace of a test's control plane with a queue tuned for tests:
`RECONCILE_TUNING` (a 1 s resync, so steady-state reconciles happen during a test) or
`REPORTING_TUNING` (status-only reconciles at most once a second, for tests of the agents'
reports). The process-wide settings it sets are restored by the test's `monkeypatch`.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace

import pytest
from kopf.testing import KopfRunner

from pd_devcluster import ControlPlaneHandle
from pd_operator import settings
from pd_operator.metrics import RECONCILES
from pd_operator.workqueue import QueueTuning

__all__ = ["RECONCILE_TUNING", "REPORTING_TUNING", "kopf_runner", "reconcile_successes",
           "run_operator"]

RECONCILE_TUNING = QueueTuning(workers=2, resync_s=1.0, base_backoff_s=0.2, max_backoff_s=2.0)
REPORTING_TUNING = QueueTuning(workers=2, resync_s=5.0, base_backoff_s=0.2, max_backoff_s=2.0,
                               status_interval_s=1.0)


@contextmanager
def kopf_runner(args: Sequence[str], timeout: float) -> Iterator[KopfRunner]:
    """Run kopf with `args` for the duration of the block.

    kopf's runner leaves its HTTP connections to the garbage collector when it stops; with
    warnings as errors, the ResourceWarning would then fail whichever later test happened to
    trigger a collection. Collect them here, where they belong.
    """
    try:
        with KopfRunner(list(args), timeout=timeout) as runner:
            yield runner
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


def run_operator(control_plane: ControlPlaneHandle, namespace: str,
                 monkeypatch: pytest.MonkeyPatch,
                 tuning: QueueTuning = RECONCILE_TUNING) -> AbstractContextManager[KopfRunner]:
    """The operator's handlers serving `namespace` of `control_plane` (standalone: no peering)
    for the duration of the block, its queue tuned by `tuning`."""
    monkeypatch.setenv("KUBECONFIG", str(control_plane.kubeconfig_path))
    # monkeypatch restores the process-wide config, so no later test inherits these.
    monkeypatch.setattr(settings, "_config", replace(
        settings.current(), kubeconfig=str(control_plane.kubeconfig_path), tuning=tuning))
    return kopf_runner(["run", "--standalone", "-m", "pd_operator.handlers",
                        "--namespace", namespace], timeout=60)


def reconcile_successes() -> float:
    """Successful reconciles so far in this process (the operator's own counter)."""
    value: float = RECONCILES.labels(result="success")._value.get()
    return value
