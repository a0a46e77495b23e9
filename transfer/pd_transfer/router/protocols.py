"""What the router sends to prefill and decode, per P/D protocol (pure: bodies in, bodies
out; ``dispatch`` does the sending).

``pd-transfer`` (our ``PDTransferConnector``; the params are built by
``pd_transfer.protocol.handoff``, the module the connector reads them with): both requests
at once, sharing a fresh ``room``; prefill is told decode's bootstrap address, decode
prefill's. Sending both at once lets prefill's first layer groups be on the wire while
later layers compute::

    prefill: {...client, max_tokens: 1, stream: false,
              kv_transfer_params: {"pd_transfer": {"room": R, "decode": "<decode bootstrap>"}}}
    decode:  {...client, kv_transfer_params: {"pd_transfer": {"room": R,
                                                               "prefill": "<prefill bootstrap>"}}}

``vllm-nixl`` (vLLM's own ``NixlConnector``, as vLLM's toy proxy drives it): prefill first,
then decode with the ``kv_transfer_params`` prefill's JSON answer carries::

    prefill: {...client, max_tokens: 1, stream: false, kv_transfer_params: NIXL_PREFILL_PARAMS}
    decode:  {...client, kv_transfer_params: <prefill's answer's kv_transfer_params>}

The prefill request computes one token: ``max_completion_tokens`` (which vLLM prefers over
``max_tokens``) becomes 1 where present; ``stream_options``, ``min_tokens`` and
``min_completion_tokens`` (which vLLM refuses above ``max_tokens``) are dropped. A client's
own ``kv_transfer_params`` never reaches an engine: they would let a client point an engine
at any host.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from pd_transfer.protocol import handoff

__all__ = [
    "NIXL_PREFILL_PARAMS",
    "nixl_decode",
    "nixl_prefill",
    "pd_transfer_decode",
    "pd_transfer_prefill",
    "prefill_only",
    "transfer_params",
]

Body = dict[str, Any]

# "Compute the prompt, keep its blocks for a remote decode": prefill's answer then holds
# the params decode needs (remote engine, blocks, host, port).
NIXL_PREFILL_PARAMS: Final[Mapping[str, Any]] = MappingProxyType({
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
})
_PREFILL_DROPPED: Final = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_only(body: Mapping[str, Any]) -> Body:
    """The client's request, cut to computing the prompt and one token, not streamed."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("kv_transfer_params", None)
    return out


def pd_transfer_prefill(body: Mapping[str, Any], room: str, decode_bootstrap: str) -> Body:
    """ParamsError (``handoff``) when the connector would refuse the room or address."""
    return {**prefill_only(body),
            "kv_transfer_params": handoff.send_params(room, decode_bootstrap)}


def pd_transfer_decode(body: Mapping[str, Any], room: str, prefill_bootstrap: str) -> Body:
    """ParamsError (``handoff``) when the connector would refuse the room or address."""
    return {**body, "kv_transfer_params": handoff.load_params(room, prefill_bootstrap)}


def nixl_prefill(body: Mapping[str, Any]) -> Body:
    return {**prefill_only(body), "kv_transfer_params": dict(NIXL_PREFILL_PARAMS)}


def nixl_decode(body: Mapping[str, Any], params: Mapping[str, Any] | None) -> Body:
    """Decode's request; without ``params`` (prefill returned none) decode computes the
    prompt itself."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params:
        out["kv_transfer_params"] = dict(params)
    return out


def transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill's JSON answer (None when absent or null);
    ValueError when the answer is not a JSON object or the params are not one."""
    try:
        parsed = json.loads(answer)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"the answer is not JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise ValueError(f"the answer is a JSON {type(parsed).__name__}, not an object")
    params = parsed.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError(f"its kv_transfer_params is a {type(params).__name__}, not an object")
    return params
