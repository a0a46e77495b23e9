"""The `gpu` marker's skip hook, the only place that decides whether a GPU test can run.

A test marked `@pytest.mark.gpu` needs one CUDA device, `@pytest.mark.gpu(devices=2)` two
(a `pytest.param(..., marks=pytest.mark.gpu)` marks one case). Where fewer are visible the
hook skips it at collection: "needs a CUDA device", "needs two CUDA devices".

A pytest plugin that needs only pytest, and torch once a collected test carries the marker
(torch is imported then, not before). `tests/conftest.py` registers it (`pytest_plugins`);
the GPU machines' runs pass `--noconftest` (the conftests import the operator's dependencies,
which those machines lack) and `-p pd_testbed.gpu`, with `devtools/` on `PYTHONPATH`
(`benchmarks/gpu_setup.sh`).
"""

from __future__ import annotations

import pytest

__all__ = ["MARKER", "cuda_devices", "devices_needed", "pytest_collection_modifyitems",
           "skip_reason"]

MARKER = "gpu"
_COUNTS = {1: "a CUDA device", 2: "two CUDA devices", 3: "three CUDA devices",
           4: "four CUDA devices", 8: "eight CUDA devices"}


def devices_needed(item: pytest.Item) -> int:
    """How many CUDA devices `item` needs: the most its `gpu` markers ask (each 1 unless it
    says `devices=N`); 0 for an unmarked test."""
    needed = 0
    for marker in item.iter_markers(MARKER):
        if marker.args or set(marker.kwargs) - {"devices"}:
            raise pytest.UsageError(f"{item.nodeid}: the gpu marker takes only devices=N, "
                                    f"got {marker.args!r} {marker.kwargs!r}")
        devices = marker.kwargs.get("devices", 1)
        if not isinstance(devices, int) or devices < 1:
            raise pytest.UsageError(f"{item.nodeid}: gpu(devices=...) must be a positive int, "
                                    f"got {devices!r}")
        needed = max(needed, devices)
    return needed


def skip_reason(devices: int) -> str:
    """Why a test that needs `devices` CUDA devices is skipped."""
    return "needs " + _COUNTS.get(devices, f"{devices} CUDA devices")


def cuda_devices() -> int:
    """CUDA devices visible to this process (0 without torch or without a CUDA build)."""
    try:
        import torch  # noqa: PLC0415 - only once a collected test is marked gpu
    except ImportError:
        return 0
    return int(torch.cuda.device_count())


@pytest.hookimpl(trylast=True)  # after `-m` has deselected what will not run
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip every collected `gpu` test that needs more CUDA devices than are visible."""
    needed = [(item, devices_needed(item)) for item in items]
    if not any(devices for _, devices in needed):
        return
    available = cuda_devices()
    for item, devices in needed:
        if devices > available:
            item.add_marker(pytest.mark.skip(reason=skip_reason(devices)))
