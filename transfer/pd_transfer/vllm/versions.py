"""The vLLM versions the connector is tested against.

The KV connector API is marked experimental by vLLM and changes between releases (hook
names, the KV cache layout, the scheduler output's fields), so an untested version is
refused at start-up rather than failing on the first request.
"""

from __future__ import annotations

from typing import Final

__all__ = ["SUPPORTED_VLLM_VERSIONS", "UnsupportedVllmVersion", "check_vllm_version"]

SUPPORTED_VLLM_VERSIONS: Final = ("0.32.0",)


class UnsupportedVllmVersion(RuntimeError):
    """The running vLLM is not one the connector was tested against."""


def _release(version: str) -> str:
    """``0.32.0`` of ``0.32.0+cpu`` or ``0.32.0.dev3``-style local suffixes are kept apart:
    only the local build tag after ``+`` is dropped (a CPU or CUDA build of one release)."""
    return version.split("+", 1)[0]


def check_vllm_version(version: str) -> None:
    """Raise UnsupportedVllmVersion unless ``version`` is a supported release."""
    if _release(version) not in SUPPORTED_VLLM_VERSIONS:
        supported = ", ".join(SUPPORTED_VLLM_VERSIONS)
        raise UnsupportedVllmVersion(
            f"PDTransferConnector supports vLLM {supported}, but vLLM {version} is installed; "
            f"install a supported vLLM or a pd-transfer release that supports {version}"
        )
