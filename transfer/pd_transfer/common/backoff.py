"""How long a client of the Kubernetes API waits after consecutive failures: exponential,
capped, with "equal jitter" (half the delay fixed, half random), so pods restarted together
spread their retries out. One rule for the agent's reporter and its spec watch and the
router's pod watch."""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Backoff"]


@dataclass(frozen=True)
class Backoff:
    base_s: float
    max_s: float

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.max_s:
            raise ValueError(f"a backoff needs 0 < base_s <= max_s, got {self.base_s} and "
                             f"{self.max_s}")

    def delay_s(self, failures: int, rng: random.Random) -> float:
        """The wait after ``failures`` consecutive failures (1: the first): between half
        and all of ``min(max_s, base_s * 2 ** (failures - 1))``."""
        delay = min(self.max_s, self.base_s * 2.0 ** max(0, failures - 1))
        return delay / 2 + rng.uniform(0, delay / 2)
