"""The transfer protocol over real NIXL (UCX on lo) between rank processes: bit-exact KV for
every acceptance topology, dtype, page size and path; a killed decode rank surfaces as an
error within a bound (docs/failure-modes.md #13, #14, #19).

Each group of rank processes is started once and reused for several cases (modes, prompt
lengths); geometries are small so the module stays within a few minutes on 2 cores.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from pd_testbed.nixl_waves import assert_waves_bit_exact
from pd_transfer.reference.selftest import SelftestConfig, SelftestGroup

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(300)]

SMALL: dict[str, Any] = {
    "layers": 2, "head_dim": 16, "requests": 2, "concurrency": 2, "timeout_s": 30.0,
    "decode_pool_mib": 4, "prefill_buffer_mib": 4,
}

GROUPS = [
    # (id, topology/geometry, [(mode, tokens), ...])
    ("tp1-1-fp8-page64", {"prefill_tp": 1, "decode_tp": 1, "kv_heads": 2, "page_size": 64,
                          "dtype": "fp8_e4m3", "tokens": 100},
     [("contiguous", 100), ("sliced", 64), ("staged", 130), ("auto", 1)]),
    ("tp2-4-bf16-page16", {"prefill_tp": 2, "decode_tp": 4, "kv_heads": 4, "page_size": 16,
                           "tokens": 37},
     [("staged", 37), ("sliced", 16), ("auto", 50)]),
    ("tp4-2-fp8-page1", {"prefill_tp": 4, "decode_tp": 2, "kv_heads": 4, "page_size": 1,
                         "dtype": "fp8_e4m3", "tokens": 29},
     [("staged", 29), ("sliced", 7)]),
    ("tp4-8-2heads-bf16-page16", {"prefill_tp": 4, "decode_tp": 8, "kv_heads": 2,
                                  "page_size": 16, "tokens": 40},
     [("auto", 40), ("sliced", 17)]),
    ("pp2xtp2-4-bf16-page16", {"prefill_tp": 2, "prefill_pp": 2, "decode_tp": 4,
                               "kv_heads": 4, "page_size": 16, "tokens": 45},
     [("staged", 45), ("sliced", 33)]),
]


@pytest.mark.parametrize(("topology", "cases"), [(g[1], g[2]) for g in GROUPS],
                         ids=[g[0] for g in GROUPS])
def test_decode_kv_is_bit_exact_for_every_topology_and_path(
    topology: dict[str, object], cases: list[tuple[str, int]]
) -> None:
    assert_waves_bit_exact(SelftestConfig(**{**SMALL, **topology}), cases)


def test_killed_decode_rank_fails_prefill_requests_within_a_bound() -> None:
    """docs/failure-modes.md #19: the decode process dies after asking for the KV, before it
    lands."""
    config = SelftestConfig(**{**SMALL, "prefill_tp": 1, "decode_tp": 1, "kv_heads": 2,
                               "tokens": 64, "timeout_s": 10.0})
    group = SelftestGroup(config)
    try:
        specs = group.make_requests(2, mode="staged")
        rooms = [s.room for s in specs]
        group.broadcast("decode", "register", specs)
        group.broadcast("prefill", "register", specs)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until prefill got every RequestKV
            states = group.broadcast("prefill", "states", rooms)[0]
            if all(s == "Transferring" for s in states.values()):
                break
            time.sleep(0.05)
        group.kill("decode")
        start = time.monotonic()
        group.broadcast("prefill", "send", rooms)
        results = group.broadcast("prefill", "wait", rooms, 25.0, timeout_s=40.0)[0]
        elapsed = time.monotonic() - start
        assert {r["state"] for r in results} == {"Failed"}
        assert {r["reason"] for r in results} <= {"PeerUnreachable", "TransferTimeout",
                                                  "TransportFailed"}
        assert elapsed < config.timeout_s + 5
    finally:
        group.close()
