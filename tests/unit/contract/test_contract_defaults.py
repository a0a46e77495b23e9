"""The transfer deadlines: the CRD's defaults, the operator's and the in-pod fallbacks.

The operator's spec model and the pod's ``Timeouts`` both read ``pd_contract.defaults``, so
comparing one with the other would pass whatever the numbers became. Each is compared here
with values written down on their own instead: the literal defaults below (seconds), and the
defaults of the CRD schema checked in under ``crds/`` (what the API server fills into a
PDDeployment that leaves ``spec.transfer.timeouts`` out). A changed default then fails here
until this file says so, and a pod that falls back on numbers the CRD does not default to
fails too.
"""

from __future__ import annotations

from typing import Any

import yaml

from pd_contract.config import TimeoutsConfig
from pd_operator.api.transfer_spec import Timeouts as SpecTimeouts
from pd_operator.build.config import build_transfer_config
from pd_testbed.checkout import REPO_ROOT
from pd_testbed.factories import make_pdd
from pd_transfer.endpoint import Timeouts as PodTimeouts

REPO = REPO_ROOT

# spec.transfer.timeouts' documented defaults, in seconds.
DEFAULTS = {
    "bootstrapSeconds": 30.0,
    "grantSeconds": 10.0,
    "transferSeconds": 60.0,
    "kvLeaseSeconds": 120.0,
}


def _crd_timeout_defaults() -> dict[str, Any]:
    """``default`` of each property of spec.transfer.timeouts in the checked-in CRD."""
    crd = yaml.safe_load((REPO / "crds" / "pd.serving.dev_pddeployments.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    timeouts = spec["properties"]["transfer"]["properties"]["timeouts"]
    return {name: prop["default"] for name, prop in timeouts["properties"].items()}


def _pod_deadlines(pod: PodTimeouts) -> dict[str, float]:
    return {
        "bootstrapSeconds": pod.bootstrap_s,
        "grantSeconds": pod.grant_s,
        "transferSeconds": pod.transfer_s,
        "kvLeaseSeconds": pod.kv_lease_s,
    }


def test_crd_defaults_the_timeouts_to_the_documented_values() -> None:
    """Guards against a changed default reaching clusters unnoticed (the API server applies
    the CRD's defaults, not the model's)."""
    assert _crd_timeout_defaults() == DEFAULTS


def test_spec_model_defaults_the_timeouts_to_the_documented_values() -> None:
    assert SpecTimeouts().model_dump(by_alias=True) == DEFAULTS


def test_a_pod_given_no_config_falls_back_on_the_crd_defaults() -> None:
    """Guards against a process started without a config (selftest, benchmarks, a connector
    before its config arrives) waiting other deadlines than a default deployment's pods."""
    assert _pod_deadlines(PodTimeouts()) == DEFAULTS
    assert _pod_deadlines(PodTimeouts()) == _crd_timeout_defaults()


def test_a_default_deployment_renders_the_crd_defaults_into_its_pods() -> None:
    """A PDDeployment without ``spec.transfer.timeouts``: its config document, read by the
    pod, carries the documented deadlines and the pod's ``Timeouts`` takes them over."""
    rendered = build_transfer_config(make_pdd()).timeouts
    assert rendered == TimeoutsConfig(
        bootstrap_seconds=30.0, grant_seconds=10.0, transfer_seconds=60.0, kv_lease_seconds=120.0
    )
    assert _pod_deadlines(PodTimeouts.from_config(rendered)) == DEFAULTS
