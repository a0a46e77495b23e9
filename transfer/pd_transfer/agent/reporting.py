"""One start-up for a pod's reporting, whichever agent runs it (vLLM's pod agent, the
engine-native sidecar, the reference engine): the reporter, then the watch that hands it
each new spec of the pod's TransferAgent, started together and stopped together
(``Reporting.stop``: the watch first, so no spec reaches a stopped reporter)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pd_contract.config import ReportingConfig
from pd_contract.transferagent import TransferAgentStatus
from pd_transfer.agent.kube import AgentClient
from pd_transfer.agent.report import ReportFacts, RequestCounts
from pd_transfer.agent.reporter import Reporter, ReporterTuning, ReportSource, Resizer
from pd_transfer.agent.spec_watch import SpecStream, SpecWatch

__all__ = ["Reporting", "start_reporting"]


@dataclass
class Reporting:
    reporter: Reporter
    watch: SpecWatch | None

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop(timeout_s=0.5)
        self.reporter.stop()


def start_reporting(facts: ReportFacts, source: ReportSource, client: AgentClient,
                    config: ReportingConfig, *, spec_stream: SpecStream | None,
                    resizer: Resizer | None = None,
                    amend: Callable[[TransferAgentStatus], TransferAgentStatus] | None = None,
                    on_spec: Callable[[dict[str, Any]], None] | None = None,
                    requests: Callable[[], RequestCounts | None] | None = None,
                    engine_requests: Callable[[], int | None] | None = None) -> Reporting:
    """Start the reporter (writes through ``client`` every ``config`` interval), then, given
    a ``spec_stream`` (the pod's TransferAgent watch), a ``SpecWatch`` that hands each new
    version to ``on_spec`` (default: the reporter's ``notify_spec``). Without one the
    reporter still reads the spec at its report interval. ``requests``: the engine's own
    request counts (``RequestCounts``), where the agent can read them; ``engine_requests``:
    the requests the engine holds now, read once per write (``Reporter``)."""
    tuning = ReporterTuning(report_interval_s=config.report_interval_seconds)
    reporter = Reporter(facts, source, client, tuning, resizer=resizer, amend=amend,
                        requests=requests, engine_requests=engine_requests).start()
    watch = (SpecWatch(spec_stream, on_spec or reporter.notify_spec).start()
             if spec_stream is not None else None)
    return Reporting(reporter, watch)
