"""Leader election on a `coordination.k8s.io/v1` Lease, so that two or more operator replicas
run and exactly one of them writes.

Every replica runs kopf's watches and keeps its work queue filled; only the holder of the
Lease runs the queue's workers. The rules are client-go's (`tools/leaderelection`):
- a candidate takes the Lease when it does not exist, is released (no holder), or has not
  changed for `lease_s` as this candidate observed it (its own clock, never the holder's
  timestamps, so clock skew between nodes does not matter); every write is a PUT carrying
  the Lease's resourceVersion, so of two candidates racing, one gets a 409;
- the holder renews every `retry_s`; it counts as leader only until `renew_deadline_s`
  after the start of its last successful renewal (`fence`). That deadline is shorter than
  `lease_s`, and a standby starts its own `lease_s` only after it sees the renewal, so the
  old leader stops writing before anyone else may start. A term whose deadline passed is
  over even if a later renewal succeeds: the reconciles refused meanwhile were dropped, so
  the replica steps down and starts a new term, which looks at every PDDeployment again;
- a graceful stop releases the Lease (holder cleared), so the standby takes over within one
  `retry_s` instead of waiting out the lease.
Not the kubernetes client's `leaderelection` module: it runs in threads on the process-wide
client configuration, offers no write fence and never releases the Lease. Not kopf's
peering: replicas of equal priority all freeze (kopf's docs), and a peer's absence is noticed
only after its lifetime (60 s by default).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from pd_operator.errors import APIUnreachable, ConflictError, LeadershipLost, OperatorError
from pd_operator.kube import LEASES, KubeClient
from pd_operator.metrics import LEADER, LEADER_TRANSITIONS

__all__ = ["ROUND_LIMIT_S", "LeaderElector", "LeaseConfig", "default_identity", "own_namespace"]

log = logging.getLogger(__name__)

# Longest a round may take: two requests with their timeouts, each retried by the client.
ROUND_LIMIT_S: Final = 60.0

_SERVICE_ACCOUNT_NAMESPACE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def default_identity() -> str:
    """`<pod name>_<random>`: unique per process, so a restarted pod with the same name does
    not mistake its predecessor's Lease for its own."""
    return f"{os.environ.get('HOSTNAME') or 'pd-operator'}_{uuid.uuid4().hex[:8]}"


def own_namespace() -> str | None:
    """The namespace this pod runs in ($POD_NAMESPACE, else its ServiceAccount's), or None
    outside a cluster."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return _SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class LeaseConfig:
    """Where the Lease lives and its timing (client-go's names). The defaults bound a
    takeover after the leader dies without a word to `lease_s + retry_s` (12 s)."""

    name: str
    namespace: str
    identity: str
    lease_s: float = 10.0
    renew_deadline_s: float = 7.0
    retry_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_s < self.renew_deadline_s < self.lease_s:
            raise ValueError(
                f"leader election needs 0 < retry ({self.retry_s} s) < renew deadline "
                f"({self.renew_deadline_s} s) < lease duration ({self.lease_s} s)")


def _micro_time(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Campaigns for the Lease (`start`) and calls back as leadership comes and goes;
    `guard()` is the write fence every write of the operator passes."""

    def __init__(
        self,
        kube: KubeClient,
        config: LeaseConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.config = config
        self._on_started: Callable[[], Awaitable[None]] | None = None
        self._on_stopped: Callable[[], Awaitable[None]] | None = None
        self._on_reconnected: Callable[[], None] | None = None
        self._unreachable = False  # the last round found no API server
        self._clock = clock
        self._fence = float("-inf")  # leader until then (monotonic seconds)
        self._leading = False
        self._observed: dict[str, Any] | None = None  # the Lease's spec as last seen
        self._observed_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._round_at = clock()  # when the last round of the campaign ended
        # Its own thread: reconciles blocked on a restarting API server hold every thread of
        # the loop's default executor for up to their timeout, and a renewal queued behind
        # them would miss its deadline (or, as a candidate, never take the Lease back).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-operator-lease")
        LEADER.labels(name=self.lease_ref).set(0)

    @property
    def lease_ref(self) -> str:
        return f"{self.config.namespace}/{self.config.name}"

    # -- the fence ---------------------------------------------------------------------

    def stalled(self) -> str | None:
        """What is wrong with the campaign, or None: a round (or the wait between two) that
        has not ended for a lease duration past its longest, or a term past its deadline
        that was not ended (client-go's leader healthz, for the liveness probe)."""
        cfg = self.config
        quiet = self._clock() - self._round_at
        if quiet > ROUND_LIMIT_S + cfg.retry_s + cfg.lease_s:
            return f"the leader election on {self.lease_ref} made no progress for {quiet:.0f} s"
        if self._leading and self._clock() > self._fence + cfg.lease_s:
            return (f"{cfg.identity} still counts itself leader of {self.lease_ref} "
                    f"{self._clock() - self._fence:.0f} s past its renewal deadline")
        return None

    def is_leading(self) -> bool:
        return self._leading and self._clock() < self._fence

    def guard(self) -> None:
        """Raise `LeadershipLost` unless this replica holds the Lease right now."""
        if not self.is_leading():
            raise LeadershipLost(
                f"this replica ({self.config.identity}) does not hold the leader Lease "
                f"{self.lease_ref}: it writes nothing until it leads again")

    # -- campaign ----------------------------------------------------------------------

    def start(self, *, on_started: Callable[[], Awaitable[None]],
              on_stopped: Callable[[], Awaitable[None]],
              on_reconnected: Callable[[], None] | None = None) -> None:
        """Campaign on the running loop: `on_started` when this replica takes the Lease,
        `on_stopped` when it loses or releases it, `on_reconnected` when the API server
        answers again after a round that could not reach it (watch events may have been
        missed, even when the outage was too short to end the term)."""
        self._on_started, self._on_stopped = on_started, on_stopped
        self._on_reconnected = on_reconnected
        self._task = asyncio.create_task(self._campaign(), name="pd-operator-leader-election")

    async def stop(self) -> None:
        """Stop campaigning; a leader stops its work first, then releases the Lease."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._leading:
            await self._step_down("stopping")
            await asyncio.get_running_loop().run_in_executor(self._thread, self._release)
        self._thread.shutdown(wait=False)

    async def _campaign(self) -> None:
        while True:
            try:
                await self._round()
            except Exception:  # the campaign outlives any one round, whatever went wrong
                log.exception("leader election on %s: unexpected error", self.lease_ref)
            self._round_at = self._clock()
            await asyncio.sleep(self.config.retry_s)

    async def _round(self) -> None:
        """One try to take or renew the Lease, and what follows from it for the term."""
        attempt = self._clock()
        try:
            held = await asyncio.get_running_loop().run_in_executor(
                self._thread, self._try_acquire_or_renew)
        except OperatorError as exc:
            log.warning("leader election on %s: %s", self.lease_ref, exc)
            self._unreachable = self._unreachable or isinstance(exc, APIUnreachable)
            held = False
        else:
            if self._unreachable and self._on_reconnected is not None:
                self._on_reconnected()
            self._unreachable = False
        if self._leading and self._clock() >= self._fence:
            # The term lapsed, even when this round renewed the Lease after the deadline:
            # writes were refused meanwhile (their reconciles dropped), so the term ends, and
            # the next one starts afresh and looks at every PDDeployment again.
            await self._step_down(f"no renewal for {self.config.renew_deadline_s:.0f} s")
        fence = attempt + self.config.renew_deadline_s
        if not held or self._clock() >= fence:
            return  # a renewal that ended past its own deadline opens no term: the next may
        self._fence = fence
        if not self._leading:
            self._leading = True
            LEADER.labels(name=self.lease_ref).set(1)
            LEADER_TRANSITIONS.labels(name=self.lease_ref).inc()
            log.info("%s leads (Lease %s)", self.config.identity, self.lease_ref)
            if self._on_started is not None:
                await self._on_started()

    async def _step_down(self, why: str) -> None:
        self._leading = False
        self._fence = float("-inf")
        LEADER.labels(name=self.lease_ref).set(0)
        log.warning("%s stops leading (Lease %s): %s", self.config.identity, self.lease_ref,
                    why)
        if self._on_stopped is not None:
            await self._on_stopped()

    # -- the Lease -----------------------------------------------------------------------

    def _try_acquire_or_renew(self) -> bool:
        """One client-go round: True when this replica holds the Lease after it."""
        cfg = self.config
        now = datetime.now(UTC)
        lease = self.kube.get(LEASES, cfg.namespace, cfg.name)
        mine = {"holderIdentity": cfg.identity, "leaseDurationSeconds": round(cfg.lease_s),
                "renewTime": _micro_time(now)}
        if lease is None:
            created = self.kube.create({
                "apiVersion": LEASES.api_version, "kind": LEASES.kind,
                "metadata": {"name": cfg.name, "namespace": cfg.namespace},
                "spec": {**mine, "acquireTime": _micro_time(now), "leaseTransitions": 0},
            })
            return created is not None
        spec: dict[str, Any] = lease.get("spec") or {}
        if spec != self._observed:
            self._observed, self._observed_at = spec, self._clock()
        holder = spec.get("holderIdentity") or ""
        duration = float(spec.get("leaseDurationSeconds") or cfg.lease_s)
        if holder not in ("", cfg.identity) and self._clock() < self._observed_at + duration:
            return False
        if holder == cfg.identity:
            mine["acquireTime"] = spec.get("acquireTime") or _micro_time(now)
            mine["leaseTransitions"] = int(spec.get("leaseTransitions") or 0)
        else:
            mine["acquireTime"] = _micro_time(now)
            mine["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        try:
            replaced = self.kube.replace({**lease, "spec": {**spec, **mine}}, lease)
        except ConflictError:
            return False  # another candidate wrote first
        if replaced is not None:
            self._observed, self._observed_at = replaced.get("spec") or {}, self._clock()
        return replaced is not None

    def _release(self) -> None:
        """Clear the holder so that a standby takes over at its next try."""
        cfg = self.config
        try:
            lease = self.kube.get(LEASES, cfg.namespace, cfg.name)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != cfg.identity:
                return
            now = _micro_time(datetime.now(UTC))
            spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1,
                    "renewTime": now}
            self.kube.replace({**lease, "spec": spec}, lease)
            log.info("%s released the Lease %s", cfg.identity, self.lease_ref)
        except OperatorError as exc:
            log.warning("could not release the Lease %s (the standby waits it out): %s",
                        self.lease_ref, exc)
