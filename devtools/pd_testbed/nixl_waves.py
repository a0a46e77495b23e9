"""Waves of transfer requests over real NIXL between rank processes
(`pd_transfer.reference.selftest`), judged bit-exact: what the NIXL integration tests of
every topology and KV format share."""

from __future__ import annotations

from collections.abc import Sequence

from pd_transfer.common.paths import PathMode
from pd_transfer.reference.selftest import SelftestConfig, SelftestGroup

__all__ = ["assert_waves_bit_exact"]


def assert_waves_bit_exact(config: SelftestConfig, cases: Sequence[tuple[PathMode, int]]) -> None:
    """Two requests per (mode, tokens) case over real NIXL: all Succeeded, decode's KV
    verified bit-exact, nothing rejected, every per-request structure empty afterwards."""
    group = SelftestGroup(config)
    try:
        for mode, tokens in cases:
            specs = group.make_requests(2, mode=mode, tokens=tokens)
            _, results = group.run_wave(specs)
            failed = [r for r in results if r["state"] != "Succeeded"]
            assert not failed, (mode, tokens, failed[:2])
            decode = [r for r in results if r["role"] == "decode"]
            assert decode and all(r["verified"] for r in decode), (mode, tokens)
        stats = group.stats()
        assert all(sum(s["rejected"].values()) == 0 for s in stats)
        for s in stats:  # every per-request structure back to empty after the waves
            assert set(s["debug_counts"].values()) <= {0}, s
    finally:
        group.close()
