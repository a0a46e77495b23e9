"""Whether a live child still holds its desired manifest: the diff behind zero-write steady states.

A child is applied only when it is missing, carries another desired-state hash, or no longer
contains the desired manifest (a hand edit); everything the server added (defaults, status,
other managers' fields) is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pd_operator.build.names import ANNOTATION_DESIRED_HASH

__all__ = ["first_difference", "is_subset", "needs_apply"]


def _is_empty(value: Any) -> bool:
    """Values Kubernetes omits (`omitempty`): None, "", [], {} and maps of only those."""
    if isinstance(value, dict):
        return all(_is_empty(v) for v in value.values())
    return value is None or value in ("", [])


def first_difference(desired: Any, live: Any, path: str = "") -> str | None:
    """Path of the first place where `desired` is not contained in `live`, or None.

    Dicts: every desired key is in live with a contained value (live may hold more keys, the
    server's defaults); a desired empty value matches a missing key. Lists: same length and
    contained element-wise. Scalars: equal.
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return path or "."
        for key, value in desired.items():
            where = f"{path}.{key}"
            if key not in live:
                if _is_empty(value):
                    continue
                return where
            diff = first_difference(value, live[key], where)
            if diff is not None:
                return diff
        return None
    if isinstance(desired, list):
        if not isinstance(live, list) or len(desired) != len(live):
            return path or "."
        for index, (d, v) in enumerate(zip(desired, live, strict=True)):
            diff = first_difference(d, v, f"{path}[{index}]")
            if diff is not None:
                return diff
        return None
    return None if desired == live else (path or ".")


def is_subset(desired: Any, live: Any) -> bool:
    """True when every field of `desired` is present in `live` with the same value."""
    return first_difference(desired, live) is None


def needs_apply(desired: Mapping[str, Any], live: Mapping[str, Any] | None) -> str | None:
    """Why `desired` must be applied over `live` (None: leave it alone)."""
    if live is None:
        return "missing"
    want = desired["metadata"]["annotations"][ANNOTATION_DESIRED_HASH]
    have = live.get("metadata", {}).get("annotations", {}).get(ANNOTATION_DESIRED_HASH)
    if want != have:
        return f"desired hash {have} -> {want}"
    diff = first_difference(dict(desired), dict(live))
    return None if diff is None else f"edited at {diff}"
