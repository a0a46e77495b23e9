"""What a router puts in a request's ``kv_transfer_params``, and the connector's settings.

A router sends each request to a prefill engine and a decode engine AT ONCE (so prefill's
first layer groups can be on the wire while later layers compute), both carrying the same
``room`` under the ``"pd_transfer"`` key:

- to prefill: ``{"pd_transfer": {"room": R, "decode": "<decode pod bootstrap host:port>"}}``
  and ``max_tokens: 1``; prefill computes the prompt's KV and writes it into decode's pages;
- to decode: ``{"pd_transfer": {"room": R, "prefill": "<prefill pod bootstrap host:port>"}}``;
  decode allocates the prompt's pages, asks prefill for the KV it lacks, and generates.

A bootstrap address names a pod's rank 0; its other TP ranks listen on the following ports.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pd_contract.names import (
    ENV_TRANSFER_AUTH_KEY_FILE,
    ENV_TRANSFER_CONFIG,
    TRANSFER_AUTH_PATH,
    TRANSFER_CONFIG_PATH,
)

__all__ = [
    "PARAMS_KEY",
    "ConnectorSettings",
    "LoadParams",
    "ParamsError",
    "SendParams",
    "read_load_params",
    "read_send_params",
]

PARAMS_KEY: Final = "pd_transfer"

RoomId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]


class ParamsError(ValueError):
    """A request's ``kv_transfer_params`` or the connector's extra config is invalid."""


def _check_address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bootstrap address {value!r} must be host:port with a port in 1-65535")
    return value


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SendParams(_Frozen):
    """A prefill request's transfer: write ``room``'s KV into the decode pod ``decode``."""

    room: RoomId
    decode: str = Field(max_length=262)

    @field_validator("decode")
    @classmethod
    def _decode_address(cls, value: str) -> str:
        return _check_address(value)


class LoadParams(_Frozen):
    """A decode request's transfer: receive ``room``'s KV from the prefill pod ``prefill``."""

    room: RoomId
    prefill: str = Field(max_length=262)

    @field_validator("prefill")
    @classmethod
    def _prefill_address(cls, value: str) -> str:
        return _check_address(value)


def _read(model: type[SendParams] | type[LoadParams], params: Mapping[str, Any] | None,
          role: str) -> Any:
    if not params or PARAMS_KEY not in params:
        return None
    try:
        return model.model_validate(params[PARAMS_KEY])
    except ValidationError as exc:
        raise ParamsError(
            f"kv_transfer_params[{PARAMS_KEY!r}] of a {role} request is invalid: "
            f"{exc.errors(include_url=False)}"
        ) from exc


def read_send_params(params: Mapping[str, Any] | None) -> SendParams | None:
    """The prefill transfer of a request, or None for a request served locally."""
    result: SendParams | None = _read(SendParams, params, "prefill")
    return result


def read_load_params(params: Mapping[str, Any] | None) -> LoadParams | None:
    """The decode transfer of a request, or None for a request prefilled locally."""
    result: LoadParams | None = _read(LoadParams, params, "decode")
    return result


class ConnectorSettings(_Frozen):
    """``kv_connector_extra_config``: where the pod's transfer config and key are, and how
    this engine is reached. Sizes, timeouts, ports and the layer pipeline come from the
    transfer config the operator renders (the same document the reference engine reads)."""

    config_file: Path = Field(
        default_factory=lambda: Path(os.environ.get(ENV_TRANSFER_CONFIG, TRANSFER_CONFIG_PATH)))
    key_file: Path = Field(
        default_factory=lambda: Path(os.environ.get(ENV_TRANSFER_AUTH_KEY_FILE,
                                                    TRANSFER_AUTH_PATH)))
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
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            raise ParamsError(
                f"kv_connector_extra_config is invalid for PDTransferConnector: "
                f"{exc.errors(include_url=False)}"
            ) from exc
