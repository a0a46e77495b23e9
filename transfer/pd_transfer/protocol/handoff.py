"""The router↔engine request contract: what a router puts in a request's
``kv_transfer_params`` for ``PDTransferConnector``, and how the connector reads it back.

A router sends each request to a prefill engine and a decode engine AT ONCE (so prefill's
first layer groups can be on the wire while later layers compute), both carrying the same
``room`` under the ``"pd_transfer"`` key:

- to prefill: ``{"pd_transfer": {"room": R, "decode": "<decode pod bootstrap host:port>"}}``
  (``send_params``) and ``max_tokens: 1``; prefill computes the prompt's KV and writes it
  into decode's pages;
- to decode: ``{"pd_transfer": {"room": R, "prefill": "<prefill pod bootstrap host:port>"}}``
  (``load_params``); decode allocates the prompt's pages, asks prefill for the KV it lacks,
  and generates.

A bootstrap address names a pod's rank 0; its other TP ranks listen on the following ports.
The router (``pd_transfer.router.protocols``) writes with the builders, the connector
(``pd_transfer.vllm.scheduler``) reads with ``read_send_params``/``read_load_params``; both
go through the same models, so what the router writes is what the connector accepts. Pure
data: no I/O, no torch, no vLLM (the router's image has neither).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = [
    "PARAMS_KEY",
    "LoadParams",
    "ParamsError",
    "RoomId",
    "SendParams",
    "load_params",
    "read_load_params",
    "read_send_params",
    "send_params",
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


def _invalid(role: str, exc: ValidationError) -> ParamsError:
    return ParamsError(f"kv_transfer_params[{PARAMS_KEY!r}] of a {role} request is invalid: "
                       f"{exc.errors(include_url=False)}")


def _build(model: type[SendParams] | type[LoadParams], role: str,
           fields: dict[str, str]) -> dict[str, Any]:
    try:
        params = model.model_validate(fields)
    except ValidationError as exc:
        raise _invalid(role, exc) from exc
    return {PARAMS_KEY: params.model_dump(mode="json")}


def send_params(room: str, decode_bootstrap: str) -> dict[str, Any]:
    """A prefill request's ``kv_transfer_params``:
    ``{"pd_transfer": {"room": room, "decode": decode_bootstrap}}``. ParamsError when the
    connector would refuse it."""
    return _build(SendParams, "prefill", {"room": room, "decode": decode_bootstrap})


def load_params(room: str, prefill_bootstrap: str) -> dict[str, Any]:
    """A decode request's ``kv_transfer_params``:
    ``{"pd_transfer": {"room": room, "prefill": prefill_bootstrap}}``. ParamsError when the
    connector would refuse it."""
    return _build(LoadParams, "decode", {"room": room, "prefill": prefill_bootstrap})


def _read(model: type[SendParams] | type[LoadParams], params: Mapping[str, Any] | None,
          role: str) -> Any:
    if not params or PARAMS_KEY not in params:
        return None
    try:
        return model.model_validate(params[PARAMS_KEY])
    except ValidationError as exc:
        raise _invalid(role, exc) from exc


def read_send_params(params: Mapping[str, Any] | None) -> SendParams | None:
    """The prefill transfer of a request, or None for a request served locally."""
    result: SendParams | None = _read(SendParams, params, "prefill")
    return result


def read_load_params(params: Mapping[str, Any] | None) -> LoadParams | None:
    """The decode transfer of a request, or None for a request prefilled locally."""
    result: LoadParams | None = _read(LoadParams, params, "decode")
    return result
