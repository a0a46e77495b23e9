"""What an engine's metric means for a TransferAgent status: the table type, and one reading.

Pure (no I/O, no clock). An ``EngineMapping`` is one engine version's table: each
``MetricSpec`` names an exposition family, its type, the roles that export it with that
meaning, what the engine's help text says and what a delta of it means here:

- SUCCEEDED (a counter, or a histogram's count): transfers that completed → transfers, window;
- FAILED (counter): this pod's transfers that failed, for ``reason`` → failures by reason,
  window, health;
- PEER_FAILED (counter): a failure this pod saw but its peer's transfer owns →
  ``recentFailures`` only;
- BYTES (a histogram's sum, or a counter; × ``scale``): bytes moved → ``bytesTotal``;
- TRANSFER_TIME (histogram, bounds × ``scale`` = seconds): transfer durations →
  ``window.transferTime``;
- QUEUE (gauge, a level): requests in the engine's queue ``queue`` → ``queues``, and
  ``liveRequests`` when ``in_flight``;
- REQUESTS (counter): requests the engine ended, whatever their outcome → ``window.requests``;
- REQUEST_ERRORS (counter): requests it ended with a server error → ``window.requestErrors``
  (an engine rollout judges new pods by their share).

A FAILED counter may count another FAILED spec's failures too (vLLM counts failed
notifications inside failed transfers): ``includes`` names those reasons, whose counts are
taken off this one so every failure has exactly one reason.

``Presence`` says when a family exists: ALWAYS (created at the engine's start; missing is a
mapping error) or ON_FIRST_EVENT (a labelled metric under prometheus_client's multiprocess
collector, as SGLang runs it, appears with its first observation; absent means none yet).
``with_family`` names a family the engine writes in the same call: while that one is there,
this one must be too (how a renamed SGLang gauge is caught). ``EngineMapping.anchor`` is a
name prefix at least one exported family must have (no ``vllm:`` metric at all: not vLLM,
or its metrics are off).

``read_metrics(mapping, role, families)`` turns one parsed scrape into a ``Reading`` or
raises ``MappingError`` naming every metric that is missing or of another type.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from pd_transfer.native.errors import MappingError
from pd_transfer.native.exposition import (
    Family,
    Histogram,
    gauge_sum,
    histogram_of,
    sample_sum,
)

__all__ = [
    "EngineMapping",
    "Kind",
    "Meaning",
    "MetricSpec",
    "Presence",
    "Reading",
    "RoleName",
    "read_metrics",
]

RoleName = Literal["prefill", "decode"]


class Kind(StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Meaning(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PEER_FAILED = "peer_failed"
    BYTES = "bytes"
    TRANSFER_TIME = "transfer_time"
    QUEUE = "queue"
    REQUESTS = "requests"
    REQUEST_ERRORS = "request_errors"


class Presence(StrEnum):
    ALWAYS = "always"
    ON_FIRST_EVENT = "on_first_event"


@dataclass(frozen=True)
class MetricSpec:
    """One row of an engine version's table (module docstring)."""

    family: str
    kind: Kind
    meaning: Meaning
    roles: frozenset[RoleName]
    doc: str
    reason: str = ""
    scale: float = 1.0
    labels: tuple[tuple[str, str], ...] = ()
    queue: str = ""
    in_flight: bool = False
    includes: tuple[str, ...] = ()
    presence: Presence = Presence.ALWAYS
    with_family: str = ""

    @property
    def key(self) -> str:
        """Unique within a table: the family, its label filter and its meaning."""
        labels = ",".join(f"{k}={v}" for k, v in self.labels)
        return f"{self.family}{{{labels}}}:{self.meaning.value}"

    @property
    def shown(self) -> str:
        """The family as an operator finds it on the engine's /metrics."""
        suffix = "_total" if self.kind is Kind.COUNTER else ""
        labels = ",".join(f'{k}="{v}"' for k, v in self.labels if v)
        return f"{self.family}{suffix}" + (f"{{{labels}}}" if labels else "")


@dataclass(frozen=True)
class EngineMapping:
    """One engine version's metric table and how to find its start time."""

    engine: str
    version: str
    connector: str
    metrics: tuple[MetricSpec, ...]
    start_time_family: str | None
    anchor: str
    missing_hint: str

    @property
    def title(self) -> str:
        return f"{self.engine} {self.version} ({self.connector})"

    def for_role(self, role: RoleName) -> tuple[MetricSpec, ...]:
        return tuple(spec for spec in self.metrics if role in spec.roles)

    def unknown_fields(self, role: RoleName) -> list[str]:
        """Status fields (wire paths) no metric of ``role`` measures; the staging ring,
        per-peer transports and the agents of the peers it is connected to are never
        exported by an engine's own connector."""
        meanings = {spec.meaning for spec in self.for_role(role)}
        live = any(spec.in_flight for spec in self.for_role(role))
        unknown = ["agents", "pendingKV", "peers", "ring", "transports"]
        if Meaning.SUCCEEDED not in meanings:
            unknown += ["transfersTotal", "window.transfers"]
        if Meaning.FAILED not in meanings:
            unknown += ["failuresTotal", "failuresByReason", "window.failures",
                        "window.failuresByReason"]
        if Meaning.BYTES not in meanings:
            unknown.append("bytesTotal")
        if Meaning.TRANSFER_TIME not in meanings:
            unknown.append("window.transferTime")
        if Meaning.QUEUE not in meanings:
            unknown.append("queues")
        if not live:
            unknown.append("liveRequests")
        if Meaning.REQUESTS not in meanings:
            unknown += ["window.requestErrors", "window.requests"]
        return sorted(unknown)


@dataclass(frozen=True)
class Reading:
    """One scrape through one table. ``counts`` hold SUCCEEDED, FAILED, PEER_FAILED and
    BYTES values by spec key (cumulative since the engine started); ``histograms`` the
    TRANSFER_TIME ones (in seconds); ``queues`` the depths by queue name (a queue whose gauge
    has no sample yet is absent); ``present`` the keys whose family was in the text."""

    counts: Mapping[str, float] = field(default_factory=dict)
    histograms: Mapping[str, Histogram] = field(default_factory=dict)
    queues: Mapping[str, float] = field(default_factory=dict)
    present: frozenset[str] = frozenset()
    start_time_s: float | None = None


_TYPES = {Kind.COUNTER: "counter", Kind.GAUGE: "gauge", Kind.HISTOGRAM: "histogram"}


def read_metrics(mapping: EngineMapping, role: RoleName,
                 families: Mapping[str, Family]) -> Reading:
    """The values ``mapping`` defines for ``role`` in ``families`` (module docstring)."""
    problems: list[str] = []
    counts: dict[str, float] = {}
    histograms: dict[str, Histogram] = {}
    queues: dict[str, float] = {}
    present: set[str] = set()
    specs = mapping.for_role(role)
    if not any(name.startswith(mapping.anchor) for name in families):
        raise MappingError(f"no {mapping.anchor}* metric is exported at all: "
                           f"{mapping.missing_hint}")
    for spec in specs:
        family = families.get(spec.family)
        if family is None:
            if spec.presence is Presence.ALWAYS or (spec.with_family
                                                    and spec.with_family in families):
                problems.append(f"{spec.shown} ({spec.kind.value}: {spec.doc}) is missing")
            elif spec.meaning is Meaning.TRANSFER_TIME:
                histograms[spec.key] = Histogram.empty()
            elif spec.meaning is not Meaning.QUEUE:
                counts[spec.key] = 0.0
            continue
        if family.type != _TYPES[spec.kind]:
            problems.append(f"{spec.shown} is a {family.type}, expected a {spec.kind.value}")
            continue
        present.add(spec.key)
        _read_one(spec, family, counts, histograms, queues)
    if problems:
        raise MappingError(f"{mapping.title} metrics of a {role}: " + "; ".join(problems)
                           + f". This agent maps {mapping.engine} {mapping.version}; another "
                           f"engine version, connector or role exports other metrics "
                           f"({mapping.missing_hint})")
    start = None
    if mapping.start_time_family is not None:
        family = families.get(mapping.start_time_family)
        if family is not None:
            start = gauge_sum(family)
    return Reading(counts, histograms, queues, frozenset(present), start)


def _read_one(spec: MetricSpec, family: Family, counts: dict[str, float],
              histograms: dict[str, Histogram], queues: dict[str, float]) -> None:
    if spec.kind is Kind.HISTOGRAM:
        hist = histogram_of(family, spec.labels) or Histogram.empty()
        if spec.meaning is Meaning.TRANSFER_TIME:
            histograms[spec.key] = hist.scaled(spec.scale)
        elif spec.meaning is Meaning.BYTES:
            counts[spec.key] = hist.sum * spec.scale
        else:
            counts[spec.key] = hist.count
    elif spec.kind is Kind.COUNTER:
        value = sample_sum(family, family.name + "_total", spec.labels)
        counts[spec.key] = (value or 0.0) * spec.scale
    else:
        value = gauge_sum(family, spec.labels)
        if value is not None and math.isfinite(value):
            queues[spec.queue] = queues.get(spec.queue, 0.0) + value
