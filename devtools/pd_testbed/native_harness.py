"""Drive the engine-native agent in-process: captured metric texts in, the statuses it writes
out. No network: the engine's metrics come from `tests/unit/data` files through a fake fetch,
the API server is an in-memory `FakeAgentAPI` (`pd_testbed.agent_fakes`), the clocks are
manual.

`Run.read(name, at_s)` makes the agent read one capture at monotonic time `at_s`;
`Run.report(at_s)` ticks its reporter at `at_s` and returns the status last written. The
agent's identity starts at `AGENT_START_UNIX_S` (before every capture's engine start, as a
sidecar started with its engine), with the config's window and failure ratio below.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pd_contract.config import TransferConfig
from pd_contract.transferagent import TransferAgentStatus
from pd_testbed.agent_fakes import FakeAgentAPI
from pd_testbed.checkout import UNIT_DATA_DIR
from pd_transfer.agent.identity import read_identity
from pd_transfer.agent.reporter import Reporter, ReporterTuning
from pd_transfer.native.agent import NativeAgent, NativeOptions
from pd_transfer.native.errors import ScrapeError, ScrapeTimeout
from pd_transfer.native.mapping import EngineMapping

__all__ = ["AGENT_START_UNIX_S", "NOW", "Run", "capture", "config", "identity_env"]

# After the captures were made (2026-11-26): their engines are older than any window.
NOW = datetime(2027, 1, 1, tzinfo=UTC)
AGENT_START_UNIX_S = 1_700_000_000.0
URL = "http://127.0.0.1:8000/metrics"
WINDOW_S = 60.0
MAX_FAILURE_RATIO = 0.05

Obj = dict[str, Any]


def capture(name: str) -> str:
    return (UNIT_DATA_DIR / name).read_text()


def identity_env(role: str) -> dict[str, str]:
    return {"POD_NAME": f"demo-{role}-0", "POD_NAMESPACE": "ns", "POD_UID": "uid-1",
            "POD_IP": "10.0.0.7", "PD_DEPLOYMENT": "demo", "PD_ROLE": role}


def config(report_interval_s: float = 5.0) -> TransferConfig:
    role = {"tensor": 1, "pipeline": 1, "data": 1, "page_size": 32, "service": "demo"}
    return TransferConfig.model_validate({
        "version": 1, "deployment": "demo", "namespace": "ns",
        "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "kv_dtype": "bfloat16",
                  "attention": "MHA"},
        "prefill": {**role, "service": "demo-prefill"},
        "decode": {**role, "service": "demo-decode"},
        "layer_pipeline": {"enabled": False, "min_tokens": 1, "min_groups": 1,
                           "max_groups": 1, "saturation": 1.0},
        "staging": {"mode": "Auto", "prefill_buffer_mib": 64, "decode_pool_mib": 256},
        "timeouts": {"bootstrap_seconds": 30, "grant_seconds": 10, "transfer_seconds": 60,
                     "kv_lease_seconds": 120},
        "reporting": {"report_interval_seconds": report_interval_s,
                      "window_seconds": WINDOW_S, "max_failure_ratio": MAX_FAILURE_RATIO},
        "network": {"rdma_required": False, "bootstrap_port": 8998, "metrics_port": 9400},
    })


@dataclass
class Run:
    """One agent over a sequence of captures (module docstring)."""

    mapping: EngineMapping
    role: str
    api: FakeAgentAPI = field(default_factory=FakeAgentAPI)
    report_interval_s: float = 5.0
    texts: list[str | Exception] = field(default_factory=list)
    now_s: float = 0.0

    def __post_init__(self) -> None:
        identity = read_identity(identity_env(self.role), started_unix_s=AGENT_START_UNIX_S)
        options = NativeOptions(mapping=self.mapping, metrics_url=URL, scrape_s=5.0,
                                metrics_port=9400, engine_port=8000)
        self.agent = NativeAgent(options, identity, config(self.report_interval_s),
                                 fetch=self._fetch, clock=lambda: self.now_s,
                                 wall=lambda: NOW)
        self.reporter = Reporter(self.agent.facts(), self.agent,
                                 self.agent.reporting_client(self.api),
                                 ReporterTuning(report_interval_s=self.report_interval_s),
                                 clock=lambda: self.now_s, wall=lambda: NOW,
                                 rng=random.Random(0), amend=self.agent.amend,
                                 requests=self.agent.request_counts)

    def _fetch(self, url: str, timeout_s: float) -> str:
        assert url == URL
        item = self.texts.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def read(self, name: str, at_s: float) -> Run:
        return self.read_text(capture(name), at_s)

    def read_text(self, text: str, at_s: float) -> Run:
        self.now_s = at_s
        self.texts.append(text)
        self.agent.read_once()
        return self

    def unreachable(self, at_s: float) -> Run:
        self.now_s = at_s
        self.texts.append(ScrapeError(f"GET {URL} failed: ConnectionRefusedError"))
        self.agent.read_once()
        return self

    def busy(self, at_s: float) -> Run:
        """A reading the engine took but did not answer within the timeout."""
        self.now_s = at_s
        self.texts.append(ScrapeTimeout(f"GET {URL} failed: TimeoutError: timed out"))
        self.agent.read_once()
        return self

    def report(self, at_s: float) -> TransferAgentStatus | None:
        """Tick the reporter at `at_s`: the status written, or None when none was due."""
        self.now_s = at_s
        if not self.reporter.tick():
            return None
        return TransferAgentStatus.model_validate(self.api.status_writes[-1])
