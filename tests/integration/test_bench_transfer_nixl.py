"""``pd-transfer bench transfer`` once at toy size over real NIXL (two rank processes, UCX on
lo): every path runs, every request is bit-exact (the benchmark raises otherwise), each
request's phases add up to its latency, and the raw WRITEs' and prefill ranks' records are
kept. A smoke test: no timing is asserted.
"""

from __future__ import annotations

import pytest

from pd_transfer.bench.phases import DIRECT_PHASES, STAGED_PHASES
from pd_transfer.bench.transfer import Combo, TransferBenchSettings, run_transfer_bench

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(180)]


def test_the_transfer_benchmark_runs_every_path_and_splits_each_latency() -> None:
    settings = TransferBenchSettings(
        device="cpu", gpus=1, combos=(Combo(1, 1, 2),), lengths=(20,),
        paths=("raw", "staged", "contiguous"), layers=2, head_dim=16, page_size=4,
        dtype="bfloat16", repeats=1, waves=1, concurrency=2, timer_slack_ns=1000)
    report = run_transfer_bench(settings, log=lambda _: None)
    (row,) = report["results"]
    # 2 layers x K,V x 20 tokens (5 pages of 4) x 2 heads x 16 x 2 bytes
    assert row["payload_bytes"] == 2 * 2 * 20 * 2 * 16 * 2
    assert set(row["paths"]) == {"raw", "staged", "contiguous"}
    for path, names in (("staged", STAGED_PHASES), ("contiguous", DIRECT_PHASES)):
        entry = row["paths"][path]
        requests = entry["requests"] + entry["wave_requests"]
        assert len(requests) == 1 + settings.concurrency
        for request in requests:
            split = request["phases"]["split_s"]
            assert list(split) == list(names)
            assert sum(split.values()) == pytest.approx(request["latency_s"], abs=1e-9)
            assert request["phases"]["path"] == path
        assert entry["in_flight"]["gb_per_s"] > 0
    assert row["paths"]["raw"]["one_in_flight"]["latency_s"] > 0
    (raw,) = row["paths"]["raw"]["requests"]  # one WRITE: one pair, one request
    assert len(raw["posted_s"]) == len(raw["done_s"]) == 1
    assert 0 < raw["posted_s"][0] <= raw["done_s"][0] == raw["latency_s"]
    (stats,) = report["prefill_stats"][settings.combos[0].name].values()
    # One WRITE per request and path: a warm-up, `repeats` and a wave of `concurrency`.
    assert stats["writes_posted"] == 3 * (1 + settings.repeats + settings.concurrency)
