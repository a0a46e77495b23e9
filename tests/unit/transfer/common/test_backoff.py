"""The one retry rule of the agent's reporter, its spec watch and the router's pod watch."""

from __future__ import annotations

import random

import pytest

from pd_transfer.common.backoff import Backoff

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(("failures", "low", "high"), [
    (0, 0.25, 0.5), (1, 0.25, 0.5), (2, 0.5, 1.0), (3, 1.0, 2.0), (4, 2.0, 4.0),
    (6, 5.0, 10.0), (60, 5.0, 10.0),  # capped at max_s, without overflowing 2 ** 59
])
def test_delays_double_per_failure_up_to_the_cap_with_half_of_each_random(
        failures: int, low: float, high: float) -> None:
    backoff = Backoff(base_s=0.5, max_s=10.0)
    delays = [backoff.delay_s(failures, random.Random(seed)) for seed in range(200)]
    assert all(low <= d <= high for d in delays), (min(delays), max(delays))
    assert max(delays) - min(delays) > (high - low) / 2  # jittered, not one fixed value


def test_the_same_random_source_gives_the_same_delays() -> None:
    backoff = Backoff(base_s=1.0, max_s=30.0)
    first = [backoff.delay_s(n, random.Random(7)) for n in range(1, 8)]
    assert first == [backoff.delay_s(n, random.Random(7)) for n in range(1, 8)]


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_a_backoff_that_cannot_grow_is_refused(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="0 < base_s <= max_s"):
        Backoff(base_s=base, max_s=cap)
