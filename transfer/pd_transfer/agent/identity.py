"""Who this engine pod is, from the environment the operator's pod template sets.

The operator's pod template puts the pod's identity in the environment through the downward
API (``POD_NAME``, ``POD_NAMESPACE``, ``POD_UID``, ``POD_IP``, ``NODE_NAME``) and the
deployment's facts as plain values (``PD_DEPLOYMENT``, ``PD_ROLE``, ``PD_TENSOR_PARALLEL``
...); both sides take the names from ``pd_contract.names``. The agent learns its pod from
here, never from the API server: its Role grants it TransferAgents only.

``read_identity`` fails with one ``IdentityError`` naming every missing or malformed
variable and where it should come from, so a hand-written pod spec is fixed in one round.
The incarnation (pod UID + process start time) tells a restarted process apart from its
predecessor in the same pod (docs/failure-modes.md #10): peers and the operator key on it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from pd_contract.defaults import TRANSFER_METRICS_PORT
from pd_contract.names import (
    DOWNWARD_API_ENV,
    ENV_DATA_PARALLEL,
    ENV_DEPLOYMENT,
    ENV_NODE_NAME,
    ENV_PIPELINE_PARALLEL,
    ENV_POD_IP,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    ENV_POD_UID,
    ENV_ROLE,
    ENV_TENSOR_PARALLEL,
    ENV_TRANSFER_METRICS_PORT,
)
from pd_transfer.agent.errors import IdentityError

__all__ = ["IdentityError", "PodIdentity", "read_identity"]

# Required; the node name is optional (only reported).
_DOWNWARD_API: Final = {name: path for name, path in DOWNWARD_API_ENV.items()
                        if name != ENV_NODE_NAME}
_PLAIN: Final = (ENV_DEPLOYMENT, ENV_ROLE)
_COUNTS: Final = (ENV_TENSOR_PARALLEL, ENV_PIPELINE_PARALLEL, ENV_DATA_PARALLEL)


@dataclass(frozen=True)
class PodIdentity:
    """This pod and process, as the agent reports them."""

    name: str
    namespace: str
    uid: str
    ip: str
    node: str
    deployment: str
    role: Literal["prefill", "decode"]
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    metrics_port: int
    started_unix_s: float

    @property
    def incarnation(self) -> str:
        """Pod UID plus process start (ms): distinct for every process a pod ever runs."""
        return f"{self.uid}-{int(self.started_unix_s * 1000)}"


def read_identity(
    env: Mapping[str, str], *, started_unix_s: float | None = None
) -> PodIdentity:
    """Parse the pod's identity from ``env`` (``os.environ`` in a pod).

    Raises IdentityError naming each missing variable with the field it is fed from
    (downward API) or the operator builder that sets it, and each malformed value.
    """
    problems: list[str] = []

    def need(name: str, source: str) -> str:
        value = env.get(name, "")
        if not value:
            problems.append(f"{name} is not set ({source})")
        return value

    fields = {name: need(name, f"downward API fieldRef {path}")
              for name, path in _DOWNWARD_API.items()}
    plain = {name: need(name, "set by the operator's pod template") for name in _PLAIN}
    counts: dict[str, int] = {}
    for name in _COUNTS:
        raw = env.get(name, "1")
        try:
            counts[name] = int(raw)
            if counts[name] < 1:
                raise ValueError
        except ValueError:
            problems.append(f"{name}={raw!r} is not a positive integer")
    raw_port = env.get(ENV_TRANSFER_METRICS_PORT, str(TRANSFER_METRICS_PORT))
    try:
        metrics_port = int(raw_port)
        if not 1 <= metrics_port <= 65535:
            raise ValueError
    except ValueError:
        problems.append(f"{ENV_TRANSFER_METRICS_PORT}={raw_port!r} is not a port number")
        metrics_port = TRANSFER_METRICS_PORT
    role = plain[ENV_ROLE]
    if role and role not in ("prefill", "decode"):
        problems.append(f"{ENV_ROLE}={role!r} must be prefill or decode")
    if problems:
        raise IdentityError(
            "cannot tell which pod this engine runs in: " + "; ".join(problems)
            + ". The operator's pod template sets all of these; a hand-written pod must too."
        )
    return PodIdentity(
        name=fields[ENV_POD_NAME],
        namespace=fields[ENV_POD_NAMESPACE],
        uid=fields[ENV_POD_UID],
        ip=fields[ENV_POD_IP],
        node=env.get(ENV_NODE_NAME, ""),
        deployment=plain[ENV_DEPLOYMENT],
        role="prefill" if role == "prefill" else "decode",
        tensor_parallel=counts[ENV_TENSOR_PARALLEL],
        pipeline_parallel=counts[ENV_PIPELINE_PARALLEL],
        data_parallel=counts[ENV_DATA_PARALLEL],
        metrics_port=metrics_port,
        started_unix_s=time.time() if started_unix_s is None else started_unix_s,
    )
