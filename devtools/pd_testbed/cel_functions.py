"""CEL functions of Kubernetes' environment that cel-python lacks, for evaluating the CRD's
rules and message expressions in tests as the API server would."""

from __future__ import annotations

import re
from typing import Any

import celpy

__all__ = ["KUBERNETES_FUNCTIONS", "cel_format"]


def cel_format(template: Any, args: list[Any]) -> Any:
    """``'...%d...%s...'.format([...])`` of the CEL strings library (the verbs our message
    expressions use: ``%d`` and ``%s``)."""
    values = iter(args)
    return celpy.celtypes.StringType(
        re.sub(r"%[ds]", lambda _match: str(next(values)), str(template)))


KUBERNETES_FUNCTIONS: dict[str, Any] = {"format": cel_format}
