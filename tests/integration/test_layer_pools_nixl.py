"""Per-layer pools in vLLM's KV cache formats over real NIXL (UCX on lo) between rank
processes: contiguous and staged paths, equal and unequal TP (fewer heads than ranks
included), every decode page checked bit-exactly against the seeded source.

Each rank's pool is built from per-layer tensors shaped as vLLM allocates them
(``KVPool.allocate_per_layer``): the CPU backend's one allocation with per-head K/V slabs
(HND, PER_HEAD), FlashAttention's ``[2, blocks, block_size, H, D]`` per layer (NHD), and
``[2, blocks, H, block_size, D]`` per layer (HND). Pools are registered with NIXL through
``registration_ranges`` and addressed by peers through the published base table.
"""

from __future__ import annotations

from typing import Any

import pytest

from pd_testbed.nixl_waves import assert_waves_bit_exact
from pd_transfer.reference.selftest import SelftestConfig, SelftestGroup

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(300)]

SMALL: dict[str, Any] = {
    "layers": 2, "head_dim": 16, "requests": 2, "concurrency": 2, "timeout_s": 30.0,
    "decode_pool_mib": 4, "prefill_buffer_mib": 4, "page_size": 16, "tokens": 40,
}
CPU = {"page_format": "hnd", "packing": "per_head"}
FLASH = {"per_layer": True}
HND = {"page_format": "hnd"}

GROUPS = [
    # (id, format + topology, [(mode, tokens), ...])
    ("cpu-tp1-1", {**CPU, "prefill_tp": 1, "decode_tp": 1, "kv_heads": 2},
     [("contiguous", 40), ("staged", 33), ("auto", 1)]),
    ("cpu-tp1-2", {**CPU, "prefill_tp": 1, "decode_tp": 2, "kv_heads": 2},
     [("staged", 40), ("auto", 17)]),
    ("cpu-tp2-1", {**CPU, "prefill_tp": 2, "decode_tp": 1, "kv_heads": 2, "dtype": "fp8_e4m3"},
     [("staged", 45)]),
    ("cpu-tp1-4-2heads", {**CPU, "prefill_tp": 1, "decode_tp": 4, "kv_heads": 2},
     [("auto", 40)]),
    ("flash-tp1-1", {**FLASH, "prefill_tp": 1, "decode_tp": 1, "kv_heads": 2},
     [("contiguous", 40), ("sliced", 20), ("staged", 33)]),
    ("flash-tp2-1", {**FLASH, "prefill_tp": 2, "decode_tp": 1, "kv_heads": 2},
     [("staged", 40), ("sliced", 17)]),
    ("hnd-tp1-2", {**HND, "prefill_tp": 1, "decode_tp": 2, "kv_heads": 2},
     [("staged", 40)]),
    ("hnd-tp1-1", {**HND, "prefill_tp": 1, "decode_tp": 1, "kv_heads": 2},
     [("contiguous", 40), ("staged", 9)]),
]


@pytest.mark.parametrize(("topology", "cases"), [(g[1], g[2]) for g in GROUPS],
                         ids=[g[0] for g in GROUPS])
def test_per_layer_pools_are_bit_exact_over_nixl(
    topology: dict[str, object], cases: list[tuple[str, int]]
) -> None:
    assert_waves_bit_exact(SelftestConfig(**{**SMALL, **topology}), cases)


def test_a_page_format_mismatch_is_refused_at_the_handshake_over_nixl() -> None:
    """A decode rank with HND pages cannot connect to prefill ranks with NHD ones: the
    bootstrap document's geometry names both values, and no transport state changes."""
    config = SelftestConfig(**{**SMALL, **CPU, "prefill_tp": 1, "decode_tp": 1,
                               "kv_heads": 2})
    group = SelftestGroup(config)
    other = SelftestGroup(SelftestConfig(**{**SMALL, **FLASH, "prefill_tp": 1,
                                            "decode_tp": 1, "kv_heads": 2}), auth=group.auth)
    try:
        other_prefill = [a for key, a in other.addresses.items() if key[0] == "prefill"]
        for key, (_, conn) in group.ranks.items():
            if key[0] == "decode":
                conn.send(("peers", other_prefill))
        answers = [group._expect(key, "peers") for key in group.ranks if key[0] == "decode"]
        assert answers, "no decode rank answered"
        for answer in answers:
            assert answer[0] == "error"
            assert "page_format='nhd' but this rank has page_format='hnd'" in answer[1]
        specs = group.make_requests(1, mode="staged")  # the group itself still works
        _, results = group.run_wave(specs)
        assert all(r["state"] == "Succeeded" for r in results)
    finally:
        group.close()
        other.close()
