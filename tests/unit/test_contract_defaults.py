"""The CRD's transfer timeouts and the in-pod defaults are the same numbers (pd_contract)."""

from __future__ import annotations

from pd_contract import defaults
from pd_operator.api.spec import Timeouts as SpecTimeouts
from pd_transfer._endpoint import Timeouts as PodTimeouts


def test_spec_and_pod_timeouts_agree() -> None:
    spec, pod = SpecTimeouts(), PodTimeouts()
    assert (spec.bootstrap_seconds, pod.bootstrap_s) == (30.0, 30.0)
    assert (spec.grant_seconds, pod.grant_s) == (10.0, 10.0)
    assert (spec.transfer_seconds, pod.transfer_s) == (60.0, 60.0)
    assert (spec.kv_lease_seconds, pod.kv_lease_s) == (120.0, 120.0)
    assert defaults.GRANT_SECONDS == 10.0

