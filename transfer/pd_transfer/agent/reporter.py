"""The agent's reporting thread: mirror the pod's transfer health into its TransferAgent.

Contract (shared with the operator; see ``report.py`` for the fields):

- one TransferAgent per engine pod, named after the pod, in its namespace, labelled with
  the deployment and role and ``app.kubernetes.io/managed-by=pd-transfer-agent``, owned by
  the Pod (garbage-collected with it). The agent creates it on its first successful
  contact (spec: deployment, role, the staging sizes it runs with) and afterwards writes
  ONLY its status;
- a status write happens at most every ``report_interval_s``, sooner when ``healthy``
  flips (but never more often than ``transition_gap_s``), so the operator hears about a
  failing pod within a tick instead of an interval;
- API errors back off exponentially with jitter (``backoff_s``), capped; a permanent
  error (RBAC, missing CRD) waits the cap. The thread never dies and never raises into
  the data plane, and the data plane never waits for it: it only reads snapshots the
  endpoints publish under their own short locks. With the API server unreachable the
  samples keep being taken, so the first report after the outage has the right window.

Staging resizes (when the engine passes a ``resizer``): the agent reads its own object's
spec at the report interval, and at once when ``notify_spec`` hands it a newer version (the
engine feeds it from a watch, ``spec_watch.py``). When ``spec.staging`` differs from the
sizes in force and ``spec.paused`` is false, it asks the engine to resize every rank and
writes a report at once with ``resizing: true``; when the resize ends it writes again at
once: on success ``staging`` = the new sizes, ``stagingSince`` = the completion time,
``registrationVersion`` = the ring's new version and ``observedGeneration`` = the spec's
generation; on failure ``lastError`` says why, the old sizes stay in force and reported,
and the same generation is not retried (a new spec change is). A spec that changes only the
size the pod's role does not allocate (a decode pod allocates the ring, ``decodePoolMiB``; a
prefill pod its buffer, ``prefillBufferMiB``) is confirmed at once, without the resizer: the
next report says the new sizes are in force, with ``resizing`` never true and
``stagingSince`` unchanged (the memory in force is the same).

An ``amend`` function, when given, gets every status just before the reporter decides
whether it is due, and returns the status to write: the engine-native agent
(``pd_transfer.native``) fills in what only it knows that way (its own health verdict,
fields its engine does not measure, queue depths), so a health flip it decides is written at
once like any other.

An ``engine_requests`` function, when given, reads the requests the engine is running or
holding waiting (``engine_load``): once per status write, after ``amend`` (an agent whose
reading is an HTTP scrape of its engine pays it once per report, not once per tick; a
bounded timeout keeps it short). Its None, or its raising, writes ``engineRequests`` as
unknown. Without one the status says what ``amend`` made of it (the engine-native agent fills
it from its own readings) or, without that, unknown.

``Reporter.tick()`` is one iteration, driven by the thread or directly by tests with a
manual clock and an in-process fake client.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from pd_contract.api import API_VERSION, TRANSFERAGENT_KIND
from pd_contract.names import AGENT_MANAGER, LABEL_DEPLOYMENT, LABEL_MANAGED_BY, LABEL_ROLE
from pd_contract.transferagent import (
    AgentStaging,
    PeerTransport,
    Role,
    TransferAgentSpec,
    TransferAgentStatus,
)
from pd_transfer.agent.errors import AgentAPIError, PermanentAPIError
from pd_transfer.agent.kube import AgentClient
from pd_transfer.agent.report import (
    Connections,
    ReportFacts,
    RequestCounts,
    WindowSample,
    build_status,
    compute_window,
    sample_of,
    trim_samples,
    with_engine_requests,
)
from pd_transfer.common.backoff import Backoff
from pd_transfer.common.metrics import TransferSnapshot

__all__ = [
    "ReportSource",
    "Reporter",
    "ReporterTuning",
    "Resizer",
    "build_transfer_agent",
    "join_resizes",
]

_log = logging.getLogger("pd_transfer.agent")


class ReportSource(Protocol):
    """What the reporter reads from the engine: cheap, thread-safe, never blocking long."""

    def snapshots(self) -> Sequence[TransferSnapshot]: ...

    def transports(self) -> Sequence[PeerTransport]: ...

    def connections(self) -> Connections:
        """This pod's agents and the peer agents it holds state for (``connections_of``)."""
        ...

    def reported(self) -> None:
        """Called after each successful write (e.g. to restart ring high-water marks)."""
        ...


Resizer = Callable[[AgentStaging], "Future[int]"]
"""Resize every rank of the pod to these sizes; the Future yields the new registration
version (decode: the rings'; prefill: 0) or raises (the old sizes stay in force)."""


R = TypeVar("R", bound="RankResize")


class RankResize(Protocol):
    """What one rank's finished resize says (``ResizeResult``, a rank's ``StagingReply``)."""

    @property
    def registration_version(self) -> int: ...

    @property
    def side(self) -> str: ...


def join_resizes(futures: Sequence[Future[R]]) -> Future[int]:
    """One ``Resizer`` Future over every rank's: once all are done, the highest registration
    version of a resized ring (0 when only prefill buffers were), or the first rank's error
    in rank order."""
    done: Future[int] = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def finished(_: Future[R]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [exc for f in futures if (exc := f.exception()) is not None]
        if errors:
            done.set_exception(errors[0])
        else:
            done.set_result(max((f.result().registration_version for f in futures
                                 if f.result().side == "ring"), default=0))

    if not futures:
        done.set_result(0)
    for future in futures:
        future.add_done_callback(finished)
    return done


@dataclass(frozen=True)
class ReporterTuning:
    """Timing of the reporter (seconds). ``report_interval_s`` comes from the config."""

    report_interval_s: float
    tick_s: float = 1.0
    transition_gap_s: float = 1.0
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0

    def backoff_s(self, failures: int, rng: random.Random) -> float:
        """Delay after ``failures`` consecutive failed attempts: exponential, capped, with
        "equal jitter" (half fixed, half random) so agents restarted together spread out."""
        return Backoff(self.backoff_base_s, self.backoff_max_s).delay_s(failures, rng)


def build_transfer_agent(facts: ReportFacts) -> dict[str, Any]:
    """The TransferAgent this pod creates for itself (wire form, no status)."""
    ident = facts.identity
    spec = TransferAgentSpec(pd_deployment=ident.deployment, role=Role(ident.role),
                             staging=facts.staging)
    return {
        "apiVersion": API_VERSION,
        "kind": TRANSFERAGENT_KIND,
        "metadata": {
            "name": ident.name,
            "namespace": ident.namespace,
            "labels": {LABEL_DEPLOYMENT: ident.deployment, LABEL_ROLE: ident.role,
                       LABEL_MANAGED_BY: AGENT_MANAGER},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": ident.name,
                                 "uid": ident.uid}],
        },
        "spec": spec.to_wire(),
    }


class Reporter:
    """Samples the source every tick and writes the status when due (module docstring)."""

    def __init__(
        self,
        facts: ReportFacts,
        source: ReportSource,
        client: AgentClient,
        tuning: ReporterTuning,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
        rng: random.Random | None = None,
        resizer: Resizer | None = None,
        amend: Callable[[TransferAgentStatus], TransferAgentStatus] | None = None,
        requests: Callable[[], RequestCounts | None] | None = None,
        engine_requests: Callable[[], int | None] | None = None,
    ) -> None:
        self.facts = facts
        self.requests = requests
        self.engine_requests = engine_requests
        self.resizer = resizer
        self.amend = amend
        self.source = source
        self.client = client
        self.tuning = tuning
        self.clock = clock
        self.wall = wall
        self.rng = rng or random.Random()
        self.writes = 0
        self.failed_attempts = 0
        self.last_error = ""
        self.last_status: TransferAgentStatus | None = None
        self._samples: list[WindowSample] = []
        self._last_write_s: float | None = None
        self._written_healthy: bool | None = None
        self._next_attempt_s = float("-inf")
        self._failures = 0
        self._resource_version: str | None = None
        self._observed_generation = 0
        self._spec: dict[str, Any] | None = None
        self._staging_since: datetime = self.wall()
        self._desired: tuple[AgentStaging, int, bool] | None = None  # staging, generation,
        #                                                               paused
        self._next_spec_poll_s = float("-inf")
        self._resize: tuple[Future[int], AgentStaging, int] | None = None
        self._failed_generation: int | None = None
        self._resize_error = ""
        self._notified: dict[str, Any] | None = None  # latest object from notify_spec
        self._notified_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # notify_spec or stop: tick now
        self._thread: threading.Thread | None = None

    # Thread ---------------------------------------------------------------------------------

    def start(self) -> Reporter:
        self._thread = threading.Thread(target=self._run, name="pd-transfer-agent",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def notify_spec(self, obj: dict[str, Any]) -> None:
        """A newer version of this pod's TransferAgent (from a watch; any thread): its spec
        is read at the next tick, which this brings forward."""
        with self._notified_lock:
            self._notified = obj
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # never let the reporter die; the data plane must not notice
                _log.exception("agent reporter tick failed (it keeps going)")
            self._wake.wait(self.tuning.tick_s)
            self._wake.clear()

    # One iteration ----------------------------------------------------------------------------

    def tick(self) -> bool:
        """Sample; write the status if due and not backing off. True if a write succeeded."""
        now_s = self.clock()
        transition = self._step_resize(now_s)
        snapshots = list(self.source.snapshots())
        window_s = self.facts.window_seconds
        self._samples.append(sample_of(now_s, snapshots,
                                       self.requests() if self.requests is not None else None))
        self._samples = trim_samples(self._samples, now_s, window_s)
        window = compute_window(self._samples, now_s, window_s)
        status = build_status(self.facts, snapshots, list(self.source.transports()), window,
                              self.wall(), connections=self.source.connections(),
                              observed_generation=self._observed_generation)
        status = status.model_copy(update={
            "resizing": self._resize is not None, "staging_since": self._staging_since,
            "last_error": self._resize_error or status.last_error})
        if self.amend is not None:
            status = self.amend(status)
        due = transition or self._due(now_s, status.healthy)
        if not due or now_s < self._next_attempt_s:
            return False
        if self.engine_requests is not None:
            status = with_engine_requests(status, self._read_engine_requests())
        try:
            self._write(status)
        except AgentAPIError as exc:
            self._failures += 1
            self.failed_attempts += 1
            self.last_error = str(exc)
            delay = (self.tuning.backoff_max_s if isinstance(exc, PermanentAPIError)
                     else self.tuning.backoff_s(self._failures, self.rng))
            self._next_attempt_s = now_s + delay
            if exc.status in {409, 404}:
                self._resource_version = None  # re-read (or re-create) before the next PUT
            log = _log.warning if self._failures in (1, 10) or self._failures % 100 == 0 \
                else _log.debug
            log("TransferAgent status write failed (%d in a row; next try in %.1f s): %s",
                self._failures, delay, exc)
            return False
        self._failures = 0
        self._next_attempt_s = float("-inf")
        self._last_write_s = now_s
        self._written_healthy = status.healthy
        self.last_status = status
        self.writes += 1
        self.source.reported()
        return True

    def _read_engine_requests(self) -> int | None:
        """The engine's requests now; None when they cannot be read (never raises)."""
        assert self.engine_requests is not None
        try:
            return self.engine_requests()
        except Exception:
            _log.exception("reading the engine's requests failed (reported as unknown)")
            return None

    def _due(self, now_s: float, healthy: bool | None) -> bool:
        if self._last_write_s is None:
            return True
        since = now_s - self._last_write_s
        if since >= self.tuning.report_interval_s:
            return True
        return healthy != self._written_healthy and since >= self.tuning.transition_gap_s

    def _write(self, status: TransferAgentStatus) -> None:
        ident = self.facts.identity
        if self._resource_version is None:
            current = self.client.get(ident.namespace, ident.name)
            if current is None:
                current = self.client.create(build_transfer_agent(self.facts))
                _log.info("created TransferAgent %s/%s", ident.namespace, ident.name)
            self._adopt(current)
        body = build_transfer_agent(self.facts)
        body["metadata"]["resourceVersion"] = self._resource_version
        body["status"] = status.model_copy(
            update={"observed_generation": self._observed_generation}).to_wire()
        if self._spec is not None:  # the server's spec, as read: a status PUT ignores it
            body["spec"] = self._spec
        self._adopt(self.client.replace_status(body))

    def _adopt(self, obj: dict[str, Any]) -> None:
        """Remember the object's resourceVersion, and its generation when its desired
        staging is what this process runs with (the only spec it can honour today)."""
        meta = obj.get("metadata", {})
        self._resource_version = meta.get("resourceVersion")
        self._spec = obj.get("spec")
        self._read_desired(obj)
        staging = obj.get("spec", {}).get("staging")
        if staging == self.facts.staging.to_wire():
            self._observed_generation = int(meta.get("generation", 0) or 0)

    # Staging resizes ---------------------------------------------------------------------------

    def _read_desired(self, obj: dict[str, Any]) -> None:
        spec = obj.get("spec") or {}
        try:
            staging = AgentStaging.model_validate(spec.get("staging"))
        except ValueError:
            return  # not a spec this agent can apply (the operator validates it)
        generation = int(obj.get("metadata", {}).get("generation", 0) or 0)
        self._desired = (staging, generation, bool(spec.get("paused", False)))

    def _step_resize(self, now_s: float) -> bool:
        """Poll the spec, start or finish a resize; True at a transition (report now)."""
        if self.resizer is None:
            return False
        with self._notified_lock:
            notified, self._notified = self._notified, None
        if notified is not None:
            self._read_desired(notified)
        if now_s >= self._next_spec_poll_s and self._resize is None:
            self._next_spec_poll_s = now_s + self.tuning.report_interval_s
            ident = self.facts.identity
            try:
                current = self.client.get(ident.namespace, ident.name)
            except AgentAPIError as exc:
                _log.debug("reading the TransferAgent spec failed: %s", exc)
            else:
                if current is not None:
                    self._read_desired(current)
        if self._resize is not None:
            future, staging, generation = self._resize
            if not future.done():
                return False
            self._resize = None
            try:
                version = future.result()
            except Exception as exc:
                self._failed_generation = generation
                self._resize_error = f"staging resize to {staging.to_wire()} failed: {exc}"
                _log.error("%s (keeps serving with %s)", self._resize_error,
                           self.facts.staging.to_wire())
                return True
            self.facts = replace(self.facts, staging=staging, registration_version=version)
            self._staging_since = self.wall()
            self._observed_generation = generation
            self._resize_error = ""
            _log.info("staging resized to %s (generation %d)", staging.to_wire(), generation)
            return True
        if self._desired is None:
            return False
        staging, generation, paused = self._desired
        if staging == self.facts.staging:
            self._observed_generation = max(self._observed_generation, generation)
            return False
        if paused or generation == self._failed_generation:
            return False
        role = Role(self.facts.identity.role)
        if staging.mib_for(role) == self.facts.staging.mib_for(role):
            # Only the other role's size moved: nothing of ours to drain or re-register, so
            # the new sizes are in force now (the rollout counts this pod as never resizing).
            self.facts = replace(self.facts, staging=staging)
            self._observed_generation = generation
            self._resize_error = ""
            _log.info("staging %s confirmed without a resize (generation %d)",
                      staging.to_wire(), generation)
            return True
        _log.info("resizing staging %s → %s (generation %d)", self.facts.staging.to_wire(),
                  staging.to_wire(), generation)
        self._resize = (self.resizer(staging), staging, generation)
        return True

