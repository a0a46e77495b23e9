"""The vLLM pod agent's own metrics, read at scrape time (``PodAgent`` registers one
``ConnectorCollector``): the requests with connector state on the scheduler and on each rank,
whether each rank's last report was read, and the requests vLLM ended and ended with an
error (which the pod's reports also count, for an engine rollout's analysis)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Final, Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pd_transfer.agent.report import RequestCounts
from pd_transfer.vllm.rank_control import RankReport

__all__ = ["LIVE_REQUESTS", "RANK_REACHABLE", "REQUESTS", "REQUEST_ERRORS",
           "ConnectorCollector", "ConnectorView"]

_log = logging.getLogger("pd_transfer.agent")

LIVE_REQUESTS: Final = "pd_transfer_connector_live_requests"
RANK_REACHABLE: Final = "pd_transfer_connector_rank_reachable"
REQUESTS: Final = "pd_transfer_connector_requests"
REQUEST_ERRORS: Final = "pd_transfer_connector_request_errors"


class ConnectorView(Protocol):
    """What the collector reads of the pod agent."""

    @property
    def tp_size(self) -> int: ...

    @property
    def scheduler_live(self) -> Callable[[], int]: ...

    @property
    def scheduler_requests(self) -> Callable[[], RequestCounts] | None: ...

    def rank_reports(self) -> Mapping[int, RankReport]: ...

    def unreadable(self) -> Mapping[int, str]: ...


class ConnectorCollector(Collector):
    """The connector's own metrics (module docstring), read at scrape time."""

    def __init__(self, agent: ConnectorView) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        live = Metric(LIVE_REQUESTS, "Requests with connector state, by side "
                      "(scheduler; rank with its rank); 0 once every transfer has ended",
                      "gauge")
        try:
            live.add_sample(LIVE_REQUESTS, {"side": "scheduler"}, float(agent.scheduler_live()))
        except Exception as exc:  # a scrape must not fail on it
            _log.debug("scheduler live requests unreadable: %s", exc)
        reachable = Metric(RANK_REACHABLE, "Whether the pod agent read this rank's last "
                           "report (1) or not (0: its samples are left out)", "gauge")
        reports, errors = agent.rank_reports(), agent.unreadable()
        for rank in range(agent.tp_size):
            reachable.add_sample(RANK_REACHABLE, {"rank": str(rank)},
                                 0.0 if rank in errors else 1.0)
            if rank not in errors and rank in reports:
                live.add_sample(LIVE_REQUESTS, {"side": "rank", "rank": str(rank)},
                                float(reports[rank].live_requests))
        yield live
        yield reachable
        if agent.scheduler_requests is None:
            return
        try:
            counts = agent.scheduler_requests()
        except Exception as exc:  # a scrape must not fail on it
            _log.debug("scheduler request counts unreadable: %s", exc)
            return
        ended = Metric(REQUESTS, "Requests the engine ended, whatever their outcome (the "
                       "connector sees each one end)", "counter")
        ended.add_sample(REQUESTS + "_total", {}, float(counts.finished))
        failed = Metric(REQUEST_ERRORS, "Requests the engine ended with a server error "
                        "(vLLM's FINISHED_ERROR, answered HTTP 500)", "counter")
        failed.add_sample(REQUEST_ERRORS + "_total", {}, float(counts.errors))
        yield ended
        yield failed
