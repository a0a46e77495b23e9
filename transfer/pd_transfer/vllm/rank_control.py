"""The pod agent's control routes on each TP rank's bootstrap server, and their client.

vLLM runs each TP rank in its own process, so the pod's agent (``pod_agent``, in the
scheduler process) reads and resizes the ranks over HTTP on 127.0.0.1, through the routes
each rank's ``BootstrapServer`` gains (``RankControl.install``):

- ``GET /v1/rank/report`` → ``RankReport``: the rank's ``TransferSnapshot``, the transports
  its UCX probe saw, its live connector requests and its Prometheus registry as text;
- ``POST /v1/rank/staging`` (``StagingRequest``) → ``StagingReply``: resize this rank's
  staging (decode: the ring; prefill: the buffer), waiting up to the transfer timeout;
- ``POST /v1/rank/reported`` (``ControlRequest``) → ``StagingReply``: the pod agent wrote a
  report; the staging's high-water mark restarts (``Endpoint.restart_staging_high_water``,
  as the reference engine does per report).

Every body travels in a ``pd_transfer.trust.auth`` frame of purpose ``control`` bound to the route
and the rank (a document frame, another rank's answer or another route's cannot pass as
one); a request frame also carries its issue time and is refused ``MAX_REQUEST_AGE_S``
later, so a captured resize cannot be replayed. Bodies are bounded both ways.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pd_contract.transferagent import AgentStaging, PeerTransport
from pd_transfer.agent.transport_probe import ProtoInfoParser, UcxLogTail, configure_environment
from pd_transfer.common.metrics import PendingKV, RecentFailure, RingWatermark, TransferSnapshot
from pd_transfer.endpoint import Endpoint
from pd_transfer.errors import TransferError
from pd_transfer.trust.auth import PeerAuth, Purpose, Unauthenticated
from pd_transfer.trust.bootstrap import BootstrapServer

__all__ = [
    "CONTROL_VERSION",
    "REPORTED_ROUTE",
    "REPORT_ROUTE",
    "STAGING_ROUTE",
    "ControlError",
    "ControlRequest",
    "RankControl",
    "RankReport",
    "SnapshotDoc",
    "StagingReply",
    "StagingRequest",
    "fetch_report",
    "open_control",
    "post_reported",
    "post_staging",
    "seal_control",
    "start_transport_probe",
]

_log = logging.getLogger(__name__)

CONTROL_VERSION: Final = 1
REPORT_ROUTE: Final = "/v1/rank/report"
STAGING_ROUTE: Final = "/v1/rank/staging"
REPORTED_ROUTE: Final = "/v1/rank/reported"
MAX_REQUEST_BYTES: Final = 4 * 1024
MAX_REPLY_BYTES: Final = 4 << 20
MAX_REQUEST_AGE_S: Final = 30.0
_POD_AGENT: Final = "pod-agent"
_RESIZE_MARGIN_S: Final = 5.0
_ERROR_CHARS: Final = 300

M = TypeVar("M", bound=BaseModel)


class ControlError(TransferError):
    """A control call to a rank failed: unreachable, refused, unauthenticated, malformed."""


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _FailureDoc(_Doc):
    room: str = Field(max_length=256)
    reason: str = Field(max_length=128)
    detail: str = Field(max_length=4096)
    at_unix_s: float


class _RingDoc(_Doc):
    capacity_bytes: int = Field(ge=0)
    used_bytes: int = Field(ge=0)
    free_bytes: int = Field(ge=0)
    largest_free_extent_bytes: int = Field(ge=0)
    high_water_bytes: int = Field(ge=0)
    pending_allocations: int = Field(ge=0)
    quarantined_bytes: int = Field(ge=0)


class _PendingDoc(_Doc):
    requests: int = Field(ge=0)
    bytes: int = Field(ge=0)
    oldest_s: float = Field(ge=0)


class SnapshotDoc(_Doc):
    """``metrics.TransferSnapshot`` on the wire (``of`` / ``to_snapshot``)."""

    role: Literal["prefill", "decode"]
    succeeded: int = Field(ge=0)
    failed: int = Field(ge=0)
    live_requests: int = Field(ge=0)
    bytes_transferred: int = Field(ge=0)
    failures_by_reason: dict[str, int] = Field(max_length=256)
    rejected_by_reason: dict[str, int] = Field(max_length=256)
    recent_failures: tuple[_FailureDoc, ...] = Field(max_length=256)
    ring: _RingDoc | None
    staging_bytes: int = Field(ge=0)
    registration_version: int = Field(ge=0)
    staging_since_unix_s: float | None
    resizing: bool
    refused_transitions: dict[str, int] = Field(max_length=256)
    pending: _PendingDoc

    @classmethod
    def of(cls, snapshot: TransferSnapshot) -> SnapshotDoc:
        return cls.model_validate(dataclasses.asdict(snapshot))

    def to_snapshot(self) -> TransferSnapshot:
        return TransferSnapshot(
            **{**self.model_dump(), "recent_failures": tuple(
                RecentFailure(**f.model_dump()) for f in self.recent_failures),
               "ring": None if self.ring is None else RingWatermark(**self.ring.model_dump()),
               "pending": PendingKV(**self.pending.model_dump())})


class PeerDoc(_Doc):
    """A peer rank whose document and connection this rank holds."""

    agent: str = Field(min_length=1, max_length=253)
    instance: str = Field(min_length=1, max_length=253)


class RankReport(_Doc):
    """One rank's state, as ``GET /v1/rank/report`` answers it."""

    v: Literal[1] = CONTROL_VERSION
    tp_rank: int = Field(ge=0)
    snapshot: SnapshotDoc
    transports: tuple[PeerTransport, ...] = Field(max_length=4096)
    agent: str = Field(default="", max_length=253, description="This rank's NIXL agent name.")
    peers: tuple[PeerDoc, ...] = Field(default=(), max_length=4096)
    live_requests: int = Field(ge=0, description="RankSide.live_requests()")
    metrics_text: str = Field(max_length=MAX_REPLY_BYTES // 2,
                              description="The rank's Prometheus registry, exposition text.")


class ControlRequest(_Doc):
    v: Literal[1] = CONTROL_VERSION
    issued_unix_s: float = Field(default_factory=time.time)


class StagingRequest(ControlRequest):
    staging: AgentStaging


class StagingReply(_Doc):
    """A resize's outcome: the registration version now in force, or why it failed (the old
    sizes then stay in force)."""

    v: Literal[1] = CONTROL_VERSION
    registration_version: int = Field(default=0, ge=0)
    side: Literal["ring", "buffer", ""] = ""
    error: str | None = Field(default=None, max_length=4096)


def _names(tp_rank: int, route: str) -> tuple[str, str]:
    return _POD_AGENT, f"rank-{tp_rank}{route}"


def seal_control(model: BaseModel, auth: PeerAuth, *, tp_rank: int, route: str,
                 reply: bool) -> bytes:
    """``model``'s JSON in a control frame for ``route`` of rank ``tp_rank`` (a request from
    the pod agent, or the rank's ``reply``)."""
    agent, rank = _names(tp_rank, route)
    sender, receiver = (rank, agent) if reply else (agent, rank)
    return auth.seal(model.model_dump_json().encode(), purpose=Purpose.CONTROL,
                     version=CONTROL_VERSION, sender=sender, receiver=receiver)


def open_control(raw: bytes, model: type[M], auth: PeerAuth, *, tp_rank: int, route: str,
                 reply: bool) -> M:
    """Verify a control frame (as ``seal_control`` made it), then parse it as ``model``;
    raises ControlError."""
    agent, rank = _names(tp_rank, route)
    sender, receiver = (rank, agent) if reply else (agent, rank)
    try:
        body = auth.open(raw, purpose=Purpose.CONTROL, version=CONTROL_VERSION,
                         sender=sender, receiver=receiver)
    except Unauthenticated as exc:
        raise ControlError(f"{route} of rank {tp_rank}: {exc.detail}") from exc
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise ControlError(f"{route} of rank {tp_rank}: invalid {model.__name__}: "
                           f"{exc.errors(include_url=False)}"[:4096]) from exc


def start_transport_probe() -> tuple[ProtoInfoParser, UcxLogTail | None]:
    """This process's UCX transport probe (``agent.transport_probe``); call it BEFORE the
    process's first NIXL agent exists, as ``reference/engine/main.py`` does."""
    path = configure_environment(os.environ, Path(tempfile.gettempdir()) / "pd-transfer-ucx")
    probe = ProtoInfoParser()
    return probe, UcxLogTail(path, probe).start() if path is not None else None


class RankControl:
    """The control routes of one rank of either role, over what every endpoint has (read on
    the server's threads: every read here is a snapshot or an atomic copy, as the reference
    engine's agent does)."""

    def __init__(self, endpoint: Endpoint[Any], auth: PeerAuth, *,
                 live_requests: Callable[[], int], probe: ProtoInfoParser | None,
                 transfer_timeout_s: float, clock: Callable[[], float] = time.time) -> None:
        self.endpoint = endpoint
        self.auth = auth
        self.tp_rank = endpoint.identity.coord.tp_rank
        self.live_requests = live_requests
        self.probe = probe
        self.transfer_timeout_s = transfer_timeout_s
        self.clock = clock

    def install(self, server: BootstrapServer) -> None:
        server.add_route("GET", REPORT_ROUTE, self.serve_report)
        server.add_route("POST", STAGING_ROUTE, self.serve_staging,
                         max_body_bytes=MAX_REQUEST_BYTES)
        server.add_route("POST", REPORTED_ROUTE, self.serve_reported,
                         max_body_bytes=MAX_REQUEST_BYTES)

    def report(self) -> RankReport:
        endpoint = self.endpoint
        transports: list[PeerTransport] = []
        if self.probe is not None:
            transports = self.probe.transports_for(endpoint.transport.agent_name,
                                                   list(endpoint.peers))
        # `peers` belongs to the worker thread; copying a dict is atomic in CPython.
        peers = tuple(PeerDoc(agent=name, instance=doc.instance)
                      for name, doc in sorted(dict(endpoint.peers).items()))
        return RankReport(
            tp_rank=self.tp_rank, snapshot=SnapshotDoc.of(endpoint.metrics.snapshot()),
            transports=tuple(transports), agent=endpoint.transport.agent_name, peers=peers,
            live_requests=self.live_requests(),
            metrics_text=generate_latest(endpoint.metrics.registry).decode())

    def serve_report(self, _body: bytes) -> tuple[int, bytes]:
        return 200, self._seal(self.report(), REPORT_ROUTE)

    def serve_staging(self, body: bytes) -> tuple[int, bytes]:
        request = self._open(body, StagingRequest, STAGING_ROUTE)
        if isinstance(request, tuple):
            return request
        return 200, self._seal(self.resize(request.staging), STAGING_ROUTE)

    def serve_reported(self, body: bytes) -> tuple[int, bytes]:
        request = self._open(body, ControlRequest, REPORTED_ROUTE)
        if isinstance(request, tuple):
            return request
        self.endpoint.restart_staging_high_water()
        return 200, self._seal(StagingReply(), REPORTED_ROUTE)

    def resize(self, staging: AgentStaging) -> StagingReply:
        """Resize this rank to its role's size in ``staging`` (``Endpoint.resize``), as
        ``EngineService.resize_staging`` does one of its ranks."""
        deadline = self.transfer_timeout_s
        future = self.endpoint.resize(staging, deadline)
        try:
            result = future.result(deadline + _RESIZE_MARGIN_S)
        except FutureTimeout:
            return StagingReply(error=f"rank {self.tp_rank}: the resize did not finish within "
                                      f"{deadline + _RESIZE_MARGIN_S:.0f} s")
        except Exception as exc:
            return StagingReply(error=f"rank {self.tp_rank}: {type(exc).__name__}: {exc}"[:4096])
        return StagingReply(registration_version=result.registration_version,
                            side="ring" if result.side == "ring" else "buffer")

    def _open(self, body: bytes, model: type[M], route: str) -> M | tuple[int, bytes]:
        try:
            request = open_control(body, model, self.auth, tp_rank=self.tp_rank, route=route,
                                   reply=False)
        except ControlError as exc:
            _log.warning("refused a control request: %s", exc)
            return 401, str(exc).encode()
        assert isinstance(request, ControlRequest)
        age = self.clock() - request.issued_unix_s
        if abs(age) > MAX_REQUEST_AGE_S:
            return 401, (f"{route} of rank {self.tp_rank}: the request was issued {age:.0f} s "
                         f"ago (at most {MAX_REQUEST_AGE_S:.0f} s): a replay, or clocks "
                         f"apart").encode()
        return request

    def _seal(self, model: BaseModel, route: str) -> bytes:
        return seal_control(model, self.auth, tp_rank=self.tp_rank, route=route, reply=True)


# Client (the pod agent) -----------------------------------------------------------------------

def _call(address: str, route: str, data: bytes | None, timeout_s: float) -> bytes:
    url = f"http://{address}{route}"
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw: bytes = response.read(MAX_REPLY_BYTES + 1)
    except urllib.error.HTTPError as exc:
        text = exc.read(_ERROR_CHARS).decode(errors="replace")
        raise ControlError(f"{url} answered {exc.code}: {text}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ControlError(f"cannot reach {url} within {timeout_s:g} s: {exc}") from exc
    if len(raw) > MAX_REPLY_BYTES:
        raise ControlError(f"{url}: answer larger than {MAX_REPLY_BYTES} bytes")
    return raw


def fetch_report(address: str, tp_rank: int, auth: PeerAuth, timeout_s: float) -> RankReport:
    """Rank ``tp_rank``'s report from its bootstrap server at ``address``; ControlError."""
    raw = _call(address, REPORT_ROUTE, None, timeout_s)
    report = open_control(raw, RankReport, auth, tp_rank=tp_rank, route=REPORT_ROUTE,
                          reply=True)
    if report.tp_rank != tp_rank:
        raise ControlError(f"{address} serves rank {report.tp_rank}, expected {tp_rank}")
    return report


def post_staging(address: str, tp_rank: int, staging: AgentStaging, auth: PeerAuth,
                 timeout_s: float) -> StagingReply:
    """Ask rank ``tp_rank`` to resize to ``staging``; the reply carries the outcome."""
    body = seal_control(StagingRequest(staging=staging), auth, tp_rank=tp_rank,
                        route=STAGING_ROUTE, reply=False)
    return open_control(_call(address, STAGING_ROUTE, body, timeout_s), StagingReply, auth,
                        tp_rank=tp_rank, route=STAGING_ROUTE, reply=True)


def post_reported(address: str, tp_rank: int, auth: PeerAuth, timeout_s: float) -> None:
    """Tell rank ``tp_rank`` a report was written (its ring high-water mark restarts)."""
    body = seal_control(ControlRequest(), auth, tp_rank=tp_rank, route=REPORTED_ROUTE,
                        reply=False)
    open_control(_call(address, REPORTED_ROUTE, body, timeout_s), StagingReply, auth,
                 tp_rank=tp_rank, route=REPORTED_ROUTE, reply=True)
