"""The two per-pod times the rollout stores on a TransferAgent, and the apply body carrying them.

A TransferAgent cannot say when its spec size was written, and an agent that does not report
`stagingSince` cannot say since when a size is in force; the executor stamps both as
annotations (`pd.serving.dev/staging-written-at`, `…-applied-at`) and the planner reads them
back (`step.staging_pods`). Written and read here, so the format is one. Pure: bodies in,
times and bodies out.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

from pd_contract.transferagent import AgentStaging
from pd_operator.api import API_VERSION, TransferAgent

__all__ = [
    "ANNOTATION_APPLIED_AT",
    "ANNOTATION_WRITTEN_AT",
    "format_stamp",
    "parse_stamp",
    "staging_apply",
]

Obj = Mapping[str, Any]

ANNOTATION_WRITTEN_AT: Final = "pd.serving.dev/staging-written-at"
ANNOTATION_APPLIED_AT: Final = "pd.serving.dev/staging-applied-at"
_STAMP: Final = "%Y-%m-%dT%H:%M:%SZ"


def format_stamp(at: datetime) -> str:
    return at.astimezone(UTC).strftime(_STAMP)


def parse_stamp(agent: Obj, key: str) -> datetime | None:
    """The time in annotation `key` of `agent`, or None (absent or unreadable)."""
    raw = (agent.get("metadata", {}).get("annotations") or {}).get(key)
    if not isinstance(raw, str):
        return None
    try:
        return datetime.strptime(raw, _STAMP).replace(tzinfo=UTC)
    except ValueError:
        return None


def staging_apply(
    agent: Obj, size: AgentStaging, *, written_at: datetime | None,
    applied_at: datetime | None,
) -> dict[str, Any]:
    """The server-side apply body for `agent`: `spec.staging` = `size` and the stamps.

    Everything this manager owns is in every body, so a stamp left out is removed (a new
    write drops the previous size's applied-at stamp). The uid makes the apply fail instead
    of re-creating an object its agent deleted meanwhile."""
    meta = agent["metadata"]
    annotations = {}
    if written_at is not None:
        annotations[ANNOTATION_WRITTEN_AT] = format_stamp(written_at)
    if applied_at is not None:
        annotations[ANNOTATION_APPLIED_AT] = format_stamp(applied_at)
    metadata: dict[str, Any] = {"name": meta["name"], "namespace": meta["namespace"],
                                "uid": meta["uid"]}
    if annotations:
        metadata["annotations"] = annotations
    return {
        "apiVersion": API_VERSION,
        "kind": TransferAgent.kind_name,
        "metadata": metadata,
        "spec": {"staging": size.to_wire()},
    }
