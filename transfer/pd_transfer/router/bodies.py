"""The JSON bodies the router itself writes: errors (OpenAI's error shape) and health.

An engine's own answers, errors included, are relayed as they are and never pass here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from pd_contract.transferagent import Role

__all__ = ["ErrorBody", "ErrorDetail", "HealthBody"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ErrorDetail(_Body):
    message: str
    type: str  # the error class's stable code (``errors.py``)
    code: int  # the HTTP status
    role: Role | None = None  # the engine's role and name when an engine failed
    engine: str | None = None


class ErrorBody(_Body):
    error: ErrorDetail


class HealthBody(_Body):
    """``GET /health``: ``ok`` (200) when each role has a ready endpoint; else
    ``unavailable`` (503) naming the roles that have none, or ``draining`` (503) while the
    router shuts down."""

    status: Literal["ok", "unavailable", "draining"]
    endpoints: dict[Role, int]
    missing: list[Role]
    message: str
