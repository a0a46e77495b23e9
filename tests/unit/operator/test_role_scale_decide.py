"""Which count wins between a PDRole (a role's scale target) and its PDDeployment
(`pd_operator.reconcile.role_scale.decide`), every case spelled out."""

from __future__ import annotations

from typing import Any

import pytest

from pd_operator.api import Role
from pd_operator.api.role_scale import PDRole
from pd_operator.reconcile.role_scale import ScaleDecision, decide

pytestmark = pytest.mark.timeout(30)


def target(replicas: int, generation: int, observed: int | None,
           recorded: str | None = None) -> dict[str, Any]:
    """A decode PDRole; `recorded`: its `pd.serving.dev/operator-replicas` annotation (None:
    none, as on a PDRole an earlier release created)."""
    status = {} if observed is None else {"status": {"observedGeneration": observed}}
    meta: dict[str, Any] = {"name": "m-decode", "generation": generation}
    if recorded is not None:
        meta["annotations"] = {"pd.serving.dev/operator-replicas": recorded}
    return {"metadata": meta,
            "spec": {"pdDeployment": "m", "role": "decode", "replicas": replicas}, **status}


FROM_PDD_TO_4 = "spec.replicas set to 4 (was 2) from the PDDeployment's spec.decode.replicas"
FROM_PDD_TO_3 = "spec.replicas set to 3 (was 2) from the PDDeployment's spec.decode.replicas"


@pytest.mark.parametrize(("deployment", "role", "expected"), [
    # Equal counts: nothing to carry, whatever the generations say; the count recorded
    # where the record is missing (an earlier release's PDRole) or lags (an edit carried).
    (2, target(2, 1, None, "2"), ScaleDecision()),
    (2, target(2, 5, 3, "2"), ScaleDecision()),
    (2, target(2, 1, None), ScaleDecision(recorded=2)),
    (2, target(2, 5, 3), ScaleDecision(recorded=2)),
    (3, target(3, 2, 1, "2"), ScaleDecision(recorded=3)),
    # Created by the operator (its count recorded), never acknowledged (a leader killed
    # before its status write), then the PDDeployment edited: the PDDeployment wins.
    (3, target(2, 1, None, "2"), ScaleDecision(target_replicas=3, recorded=3,
                                                message=FROM_PDD_TO_3)),
    (3, target(2, 1, 0, "2"), ScaleDecision(target_replicas=3, recorded=3,
                                             message=FROM_PDD_TO_3)),
    # Copied from the PDDeployment (generation 3), unacknowledged, then edited again.
    (4, target(2, 3, 2, "2"), ScaleDecision(target_replicas=4, recorded=4,
                                             message=FROM_PDD_TO_4)),
    # Moved through /scale (the annotation cannot follow): the PDRole wins, acknowledged
    # or not, and when both changed.
    (2, target(3, 2, 1, "2"), ScaleDecision(
        deployment_replicas=3, recorded=3,
        message="spec.decode.replicas set to 3 (was 2) from PDRole m-decode, generation 2")),
    (4, target(3, 2, 2, "2"), ScaleDecision(
        deployment_replicas=3, recorded=3,
        message="spec.decode.replicas set to 3 (was 4) from PDRole m-decode, generation 2")),
    (2, target(0, 2, 1, "2"), ScaleDecision(
        deployment_replicas=0, recorded=0,
        message="spec.decode.replicas set to 0 (was 2) from PDRole m-decode, generation 2")),
    # A record that is no count counts as none: the generation rule.
    (4, target(2, 3, 3, "two"), ScaleDecision(target_replicas=4, recorded=4,
                                               message=FROM_PDD_TO_4)),
    # No record (an earlier release's PDRole): the generation rule. Changed since the
    # operator last carried it over: it wins.
    (2, target(3, 2, 1), ScaleDecision(
        deployment_replicas=3, recorded=3,
        message="spec.decode.replicas set to 3 (was 2) from PDRole m-decode, generation 2")),
    (2, target(0, 1, None), ScaleDecision(
        deployment_replicas=0, recorded=0,
        message="spec.decode.replicas set to 0 (was 2) from PDRole m-decode, generation 1")),
    # Only the PDDeployment changed: the PDRole follows.
    (4, target(2, 3, 3), ScaleDecision(target_replicas=4, recorded=4, message=FROM_PDD_TO_4)),
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
