"""The reconcile work queue with real work functions (no mocks) on a real event loop.
No cluster needed; delays are tens of milliseconds."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import replace

import pytest

from pd_operator.errors import ConflictError, TransientAPIError
from pd_operator.workqueue import QueueTuning, RecheckAfter, WorkQueue

FAST = QueueTuning(workers=2, resync_s=60.0, conflict_delay_s=0.01, base_backoff_s=0.02,
                   max_backoff_s=0.08)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, timeout=5))


def test_backoff_doubles_and_is_capped() -> None:
    tuning = QueueTuning(base_backoff_s=0.5, max_backoff_s=4.0)
    assert [tuning.backoff_s(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_conflict_is_retried_soon_without_counting_as_failure() -> None:
    """Guards against docs/failure-modes.md #24: a 409 from a stale status write must converge."""
    calls: list[int] = []

    async def work(key: str, failures: int) -> bool:
        calls.append(failures)
        if len(calls) < 3:
            raise ConflictError("status changed since read")
        return True

    async def scenario() -> None:
        queue: WorkQueue[str] = WorkQueue(work, FAST)
        queue.start()
        queue.add("ns/a")
        while len(calls) < 3:
            await asyncio.sleep(0.005)
        await queue.wait_idle()
        assert queue.failures("ns/a") == 0
        delay = queue.delayed("ns/a")
        assert delay is not None and delay > 50  # resync scheduled after the success
        await queue.stop()

    run(scenario())
    assert calls == [0, 0, 0]  # conflicts never count as failures


def test_errors_back_off_and_report_consecutive_failures() -> None:
    seen: list[tuple[int, float]] = []

    async def work(key: str, failures: int) -> bool:
        seen.append((failures, asyncio.get_running_loop().time()))
        if failures < 3:
            raise TransientAPIError("503")
        return False  # object gone: forget the key

    async def scenario() -> None:
        queue: WorkQueue[str] = WorkQueue(work, FAST)
        queue.start()
        queue.add("k")
        while len(seen) < 4:
            await asyncio.sleep(0.005)
        await queue.wait_idle()
        assert queue.delayed("k") is None and queue.failures("k") == 0
        await queue.stop()

    run(scenario())
    assert [f for f, _ in seen] == [0, 1, 2, 3]
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(seen)]
    # 0.02, 0.04, 0.08 s (the cap) apart, give or take scheduling.
    for gap, want in zip(gaps, (0.02, 0.04, 0.08), strict=True):
        assert gap == pytest.approx(want, abs=0.015) or gap > want


def test_duplicates_coalesce_and_one_key_is_never_processed_twice_at_once() -> None:
    active: Counter[str] = Counter()
    runs: Counter[str] = Counter()
    overlap: list[str] = []

    async def work(key: str, failures: int) -> bool:
        active[key] += 1
        if active[key] > 1:
            overlap.append(key)
        runs[key] += 1
        await asyncio.sleep(0.02)
        active[key] -= 1
        return True

    async def scenario() -> None:
        queue: WorkQueue[str] = WorkQueue(work, FAST)
        for _ in range(10):
            queue.add("a")  # coalesced into one queued item
        queue.add("b")
        assert queue.depth == 2
        queue.start()
        await asyncio.sleep(0.005)
        for _ in range(5):
            queue.add("a")  # while "a" runs: exactly one more run afterwards
        await asyncio.sleep(0.01)
        await queue.wait_idle()
        await queue.stop()

    run(scenario())
    assert overlap == []
    assert runs == {"a": 2, "b": 1}


def test_a_failing_key_does_not_stop_other_keys() -> None:
    done: list[str] = []

    async def work(key: str, failures: int) -> bool:
        if key == "bad":
            raise RuntimeError("unexpected bug in one reconcile")
        done.append(key)
        return True

    async def scenario() -> None:
        queue: WorkQueue[str] = WorkQueue(work, QueueTuning(workers=1, base_backoff_s=10))
        queue.start()
        for key in ("bad", "x", "y"):
            queue.add(key)
        await queue.wait_idle()
        assert queue.failures("bad") == 1
        await queue.stop()

    run(scenario())
    assert done == ["x", "y"]


def test_throttled_adds_cost_one_run_per_interval_and_plain_adds_stay_immediate() -> None:
    """Guards against one status write per agent report: 50 reports within the interval
    are folded into one run at `last start + interval`; a spec change (plain add) is not
    delayed by the throttle."""
    starts: list[float] = []

    async def work(key: str, failures: int) -> bool:
        starts.append(asyncio.get_running_loop().time())
        return True

    async def scenario() -> list[bool]:
        queue: WorkQueue[str] = WorkQueue(work, replace(FAST, status_interval_s=0.2))
        queue.start()
        first = queue.add_throttled("k")  # never run before: due now
        await queue.wait_idle()
        folded = []
        for _ in range(50):
            folded.append(queue.add_throttled("k"))
            await asyncio.sleep(0.001)
        delay = queue.delayed("k")
        assert delay is not None and 0.05 < delay <= 0.2
        while len(starts) < 2:
            await asyncio.sleep(0.01)
        queue.add("k")  # a spec change right after: immediate, not throttled
        while len(starts) < 3:
            await asyncio.sleep(0.005)
        await queue.stop()
        return [first, *folded]

    results = run(scenario())
    assert results[0] is True and results[1] is True and not any(results[2:])
    assert len(starts) == 3
    assert starts[1] - starts[0] == pytest.approx(0.2, abs=0.05)
    assert starts[2] - starts[1] < 0.05


def test_recheck_after_requeues_sooner_than_resync() -> None:
    starts: list[float] = []

    async def work(key: str, failures: int) -> bool | RecheckAfter:
        starts.append(asyncio.get_running_loop().time())
        return RecheckAfter(0.05) if len(starts) == 1 else True

    async def scenario() -> None:
        queue: WorkQueue[str] = WorkQueue(work, FAST)  # resync after 60 s
        queue.start()
        queue.add("k")
        while len(starts) < 2:
            await asyncio.sleep(0.005)
        await queue.wait_idle()
        delay = queue.delayed("k")
        assert delay is not None and delay > 50  # back to the resync after the recheck
        await queue.stop()

    run(scenario())
    assert starts[1] - starts[0] == pytest.approx(0.05, abs=0.03)
