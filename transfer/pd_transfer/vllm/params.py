"""The connector's own settings (``kv_connector_extra_config``).

What a router puts in a request's ``kv_transfer_params`` (the room, the peer's bootstrap
address) is the router↔engine contract, ``pd_transfer.protocol.handoff``, which the router
imports too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pd_contract.names import (
    ENV_TRANSFER_AUTH_KEY_FILE,
    ENV_TRANSFER_CONFIG,
    ENV_TRANSFER_IDENTITY_FILE,
    TRANSFER_AUTH_PATH,
    TRANSFER_CONFIG_PATH,
)
from pd_transfer.protocol.handoff import ParamsError

__all__ = ["ConnectorSettings"]


class ConnectorSettings(BaseModel):
    """``kv_connector_extra_config``: where the pod's transfer config and key are, and how
    this engine is reached. Sizes, timeouts, ports and the layer pipeline come from the
    transfer config the operator renders (the same document the reference engine reads)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config_file: Path = Field(
        default_factory=lambda: Path(os.environ.get(ENV_TRANSFER_CONFIG, TRANSFER_CONFIG_PATH)))
    key_file: Path = Field(
        default_factory=lambda: Path(os.environ.get(ENV_TRANSFER_AUTH_KEY_FILE,
                                                    TRANSFER_AUTH_PATH)))
    identity_file: Path | None = Field(
        default_factory=lambda: Path(p) if (p := os.environ.get(ENV_TRANSFER_IDENTITY_FILE))
        else None,
        description="This pod's identity (docs/failure-modes.md #59); absent: the shared "
                    "key alone.")
    bind_host: str = "0.0.0.0"
    instance: str | None = Field(default=None, min_length=1, max_length=253,
                                 description="Default: $POD_NAME, else vLLM's engine id.")
    path: Literal["auto", "staged", "contiguous"] = "auto"
    timeline_file: Path | None = Field(
        default=None, description="JSON lines of the connector's timestamps (see timeline).")
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535,
                                       description="Overrides the config's (tests: one host).")
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="The pod agent's Prometheus port; 0 or absent: the config's (tests: "
                    "several pods on one host).")
    engine_port: int | None = Field(
        default=None, ge=1, le=65535,
        description="vLLM's API server port, reported in the TransferAgent's endpoints "
                    "(vLLM's config does not carry it); absent: not reported.")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """ParamsError (the connector's one configuration error) when invalid."""
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            raise ParamsError(
                f"kv_connector_extra_config is invalid for PDTransferConnector: "
                f"{exc.errors(include_url=False)}"
            ) from exc
