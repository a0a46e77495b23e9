"""Reconciling PDDeployments, one job per module.

`diff` (does a live child still hold its manifest), `gates` (the pods' transfer-ready
conditions), `events` (which changes become Events, and which are bad news),
`transfer_key` (the transfer key Secret's keys: kept, rotated or made), `children` (apply
what differs, delete what is no longer desired; a refused kind never stops the others),
`reconciler`
(one level-based reconcile: parse, build, apply, observe once, status, rollout, gates,
Events) and `loop` (the reconciler behind the work queue). Read them in that order.
"""

from pd_operator.reconcile.diff import first_difference, is_subset, needs_apply
from pd_operator.reconcile.events import transition_events
from pd_operator.reconcile.gates import GateChange, transfer_gate_changes
from pd_operator.reconcile.loop import ReconcileLoop
from pd_operator.reconcile.reconciler import (
    DEGRADED_AFTER_FAILURES,
    STALE_RECHECK_SLACK_S,
    Reconciler,
)

__all__ = [
    "DEGRADED_AFTER_FAILURES",
    "STALE_RECHECK_SLACK_S",
    "GateChange",
    "ReconcileLoop",
    "Reconciler",
    "first_difference",
    "is_subset",
    "needs_apply",
    "transfer_gate_changes",
    "transition_events",
]
