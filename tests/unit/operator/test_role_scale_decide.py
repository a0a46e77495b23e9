"""Which count wins between a PDRole (a role's scale target) and its PDDeployment
(`pd_operator.reconcile.role_scale.decide`), every case spelled out."""

from __future__ import annotations

from typing import Any

import pytest

from pd_operator.api import Role
from pd_operator.api.role_scale import PDRole
from pd_operator.reconcile.role_scale import ScaleDecision, decide

pytestmark = pytest.mark.timeout(30)


def target(replicas: int, generation: int, observed: int | None) -> dict[str, Any]:
    status = {} if observed is None else {"status": {"observedGeneration": observed}}
    return {"metadata": {"name": "m-decode", "generation": generation},
            "spec": {"pdDeployment": "m", "role": "decode", "replicas": replicas}, **status}


@pytest.mark.parametrize(("deployment", "role", "expected"), [
    # Equal counts: nothing to carry, whatever the generations say.
    (2, target(2, 1, None), ScaleDecision()),
    (2, target(2, 5, 3), ScaleDecision()),
    # The PDRole changed since the operator last carried it over: it wins.
    (2, target(3, 2, 1), ScaleDecision(
        deployment_replicas=3,
        message="spec.decode.replicas set to 3 (was 2) from PDRole m-decode, generation 2")),
    (2, target(0, 1, None), ScaleDecision(
        deployment_replicas=0,
        message="spec.decode.replicas set to 0 (was 2) from PDRole m-decode, generation 1")),
    # Only the PDDeployment changed: the PDRole follows.
    (4, target(2, 3, 3), ScaleDecision(
        target_replicas=4,
        message="spec.replicas set to 4 (was 2) from the PDDeployment's spec.decode.replicas")),
])
def test_the_edit_not_yet_carried_over_wins(deployment: int, role: dict[str, Any],
                                            expected: ScaleDecision) -> None:
    assert decide(Role.DECODE, deployment, role) == expected


def test_the_scale_target_validates_its_count() -> None:
    """The same limits as spec.<role>.replicas (the CRD's schema comes from this model)."""
    PDRole.model_validate({"spec": {"pdDeployment": "m", "role": "prefill", "replicas": 0}})
    for bad in (-1, 10001):
        with pytest.raises(ValueError, match=r"spec\.replicas"):
            PDRole.model_validate({"spec": {"pdDeployment": "m", "role": "prefill",
                                            "replicas": bad}})
